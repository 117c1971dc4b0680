"""Print docs/design.md's module map: every module of model/, dataset/, trainer/ and scripts/ with the first sentence of
its docstring, folder by folder (each folder's own line from its __init__.py), and pretraining's reading order: first
the files that explain one optimizer step (STEP_FIRST, chosen by hand), then every file a real 2-step pretraining run
loads, with their lines. `python scripts/module_map.py --write` replaces both in docs/design.md; tests/test_house.py
checks that the map names every module, the step block is current and short, and the reading order names every file.

The one measure of what a command reads (`loaded_files`, used by tests/test_house.py and tests/test_rooms.py too): the
repository files in `sys.modules` of a fresh interpreter after it ran the command, package __init__ files included,
so a module loaded when used counts on the runs that use it, and only on those."""
import ast
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the floors, bottom first; then scripts/ and its packages
FOLDERS = ("model", "model/export", "model/weights", "dataset", "dataset/demo", "dataset/tokenizing", "trainer/base",
           "trainer/parallel", "trainer/ckpt", "trainer/judge", "trainer/observe", "trainer/runtime", "trainer/plan",
           "trainer/core", "trainer/stages", "trainer/rl", "trainer", "scripts", "scripts/benchmarks", "scripts/curate",
           "scripts/inference", "scripts/planner", "scripts/serve")
LONGEST = 160  # characters of a module's line
BEGIN, END = "<!-- module map: begin (scripts/module_map.py --write) -->", "<!-- module map: end -->"
READ_BEGIN, READ_END = "<!-- reading order: begin (scripts/module_map.py --write) -->", "<!-- reading order: end -->"
PACKAGES = ("trainer", "model", "dataset")


def first_sentence(path):
    """The docstring's first sentence, on one line (empty when the module has none)."""
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    text = " ".join(doc.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = match.group(1) if match else text
    if len(sentence) > LONGEST:
        sentence = sentence[:sentence.rfind(" ", 0, LONGEST)] + " ..."
    return sentence.replace("|", "\\|")


def module_map():
    lines = [BEGIN, "", "## Module map", ""]
    for folder in FOLDERS:
        full = os.path.join(ROOT, folder)
        init = os.path.join(full, "__init__.py")
        lines += [f"### {folder}/", ""]
        if os.path.exists(init) and first_sentence(init):
            lines += [first_sentence(init), ""]
        lines += ["| module | what it holds |", "| --- | --- |"]
        for name in sorted(os.listdir(full)):
            if name.endswith((".py", ".sh")) and name != "__init__.py":
                what = first_sentence(os.path.join(full, name)) if name.endswith(".py") else "a shell script"
                lines.append(f"| `{folder}/{name}` | {what} |")
        lines.append("")
    return "\n".join(lines + [END])


def module_path(name):
    """The file of project module `name` (a package: its __init__.py), or None when it is not one."""
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def from_module(node, path):
    """The absolute module an `from ... import` statement in file `path` names; a relative one (only the files an
    export ships as remote code use them: scripts/convert_model.py) resolved against the file's package."""
    if node.level == 0:
        return node.module
    package = os.path.relpath(path, ROOT).split(os.sep)[:-1]
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


def imports_in_order(path):
    """The project modules a file imports (imports inside functions too), in the order the source names them."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        module = from_module(node, path) if isinstance(node, ast.ImportFrom) else None
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [f"{module}.{a.name}" for a in node.names] + [module] if module else []
        for name in names:
            parts = name.split(".")
            module = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                           if parts[0] in PACKAGES and module_path(".".join(parts[:k]))), None)
            if module and module not in found:
                found.append(module)
    return found


# ------------------------------------------------------------------------------------- one optimizer step
# The files that explain one optimizer step of pretraining, in the order a student reads them (entry script, build,
# loop, batches, model, dataset, schedule, clip, optimizer, objective), each with what one reads there: chosen by
# hand, here only. `--write` opens docs/design.md with them and their lines; tests/test_house.py checks that a real
# 2-step run loads each and that the block stays within its bound. Plan, checkpoints, guards and logging run around the
# step and are left to the full map.
STEP_FIRST = (
    ("trainer/train_pretrain.py", "the entry script: the flags, then the numbered phases (set-up, data, build, loop)"),
    ("trainer/core/build.py", "setup (flags -> one frozen TrainPlan, process group, mesh, seed) and build_trainer "
     "(model, parallel wrap, optimizer) into the Trainer a step runs on"),
    ("trainer/core/loop.py", "train(): the loop over epochs and steps; train_step(): one optimizer step (the lr, each "
     "micro-batch's forward and backward, unscale, clip, the optimizer's step)"),
    ("trainer/core/data_loading.py", "the datasets of --data_path and the DataLoader of one data-parallel rank's "
     "micro-batches, an epoch's order a function of (seed, epoch)"),
    ("trainer/core/batches.py", "a batch on its way into the model: targets shifted from the labels, device copies, "
     "autocast"),
    ("model/model_minimind.py", "the model: config, RMSNorm, RoPE, attention (the document mask of packed rows), "
     "SwiGLU MLP, blocks, and the loss (the cross-entropy a chunk of rows at a time)"),
    ("dataset/lm_dataset.py", "PretrainDataset: bos + text + eos, packed into rows of --max_seq_len, each row's "
     "position ids restarting at every document"),
    ("dataset/shards.py", "the token cache the rows are cut from: flat token arrays and document offsets, "
     "memory-mapped"),
    ("trainer/runtime/schedule.py", "lr_at: linear warm-up, then MiniMind's cosine to 0.1 x the peak"),
    ("trainer/parallel/clip.py", "the global gradient-norm clip, the norm one process would compute whatever the "
     "layout"),
    ("trainer/runtime/optimizer_choice.py", "build_optimizer: the --optimizer entry of OPTIMIZERS (AdamW, fused) over "
     "the trainable parameters"),
    ("trainer/plan/objective.py", "LMObjective: what train_step minimises, the mean CE over the step's target tokens "
     "(+ the MoE aux loss), counted from the CPU labels"),
)
STEP_TITLE = "## One optimizer step, in reading order"


def step_block():
    """The step-first block of docs/design.md: STEP_FIRST with each file's lines, and their sum."""
    rows = [(path, line_count(os.path.join(ROOT, path)), what) for path, what in STEP_FIRST]
    lines = [STEP_TITLE, "", "What one optimizer step of `python trainer/train_pretrain.py` runs, in the order to read "
             f"it: {len(rows)} files, {sum(n for _, n, _ in rows)} lines (scripts/module_map.py STEP_FIRST; "
             "tests/test_house.py checks that a real run loads each file and bounds the block). The plan's checks, "
             "checkpoints, guards and logging run around this step; the full list of what a run loads follows.", "",
             "| # | file | lines | what you read here |", "| --- | --- | --- | --- |"]
    lines += [f"| {i} | `{path}` | {n} | {what} |" for i, (path, n, what) in enumerate(rows, 1)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- what a run loads
PRETRAIN = "trainer/train_pretrain.py"
# a real pretraining run, 2 optimizer steps of a tiny model on a small file (DATA_ROWS rows) in a temporary folder,
# every other flag at its default
TINY_RUN = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads",
            "2", "--dtype", "float32", "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "1",
            "--max_steps", "2"]
DATA_ROWS = 48


def line_count(path):
    with open(path) as f:
        return len(f.read().splitlines())


def loaded_files(jobs, found={}):
    """What each job loads: {job: [(repository path, lines)] in load order}, the job's own file first.

    A job is (script, argv): the script run as `python script argv` (argv "{tmp}" is a fresh temporary folder shared
    by the jobs of one call, "{data}" a small pretraining file in it), or (script, None): the script imported, its
    `__main__` block not run. One fresh interpreter imports torch and transformers (no repository module), then forks
    one process per job, in order (a later job sees the files an earlier one wrote: the second of two runs finds the
    token cache the first built); each reports the repository files in its `sys.modules`. Measured once per process
    (`found`: the answers so far)."""
    if jobs in found:
        return found[jobs]
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--loaded", json.dumps(jobs)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {jobs} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    paths = json.loads(result.stdout.strip().splitlines()[-1])
    found[jobs] = {job: [(path, line_count(os.path.join(ROOT, path))) for path in files]
                   for job, files in zip(jobs, paths)}
    return found[jobs]


def pretraining_loads():
    """(first run, second run): the files of two 2-step pretraining runs (TINY_RUN) on one token cache: the first
    builds the cache, the second reads it (a run's usual case)."""
    first, second = ((PRETRAIN, (*TINY_RUN, "--data_path", "{data}", "--cache_dir", "{tmp}/cache", "--save_dir",
                                 f"{{tmp}}/out{n}", "--checkpoint_dir", f"{{tmp}}/ckpt{n}")) for n in (1, 2))
    found = loaded_files((first, second))
    return found[first], found[second]


def _write_data(path):
    """DATA_ROWS short documents (pretraining's {"text": ...} rows), enough for 2 steps of TINY_RUN."""
    words = "the model reads one document after another and learns which token follows which".split()
    with open(path, "w") as f:
        for i in range(DATA_ROWS):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(words[(i + k) % len(words)] for k in range(40))})
                    + "\n")


def _measure(jobs):
    """The body of `--loaded`: each job in a process forked from this one (see loaded_files); prints the JSON list."""
    import torch  # noqa: F401  (third-party only: each job then loads every repository module itself)
    import transformers  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="module_map_") as tmp:  # the jobs' outputs (~20 MB) go with it
        data = os.path.join(tmp, "data.jsonl")
        _write_data(data)
        found = []
        for script, argv in jobs:
            report, log = os.path.join(tmp, "report.json"), os.path.join(tmp, "log.txt")
            pid = os.fork()
            if pid == 0:
                _run_job(os.path.join(ROOT, script), argv and [a.format(tmp=tmp, data=data) for a in argv], report,
                         log)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0 or not os.path.exists(report):
                sys.stderr.write(open(log).read()[-5000:])
                return 1
            with open(report) as f:
                found.append([os.path.normpath(script)] + json.load(f))
            os.remove(report)
    print(json.dumps(found))
    return 0


def _run_job(path, argv, report, log):
    """In the forked process: run (argv given) or import `path`, then write the repository files it loaded."""
    code = 1
    try:
        with open(log, "w") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        sys.argv, sys.path[0] = [path, *(argv or [])], os.path.dirname(path)  # as `python path argv` has them
        try:
            runpy.run_path(path, run_name="__main__" if argv is not None else "__loaded__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        # this file is the interpreter's __main__ (and multiprocessing's __mp_main__ alias of it): not the job's
        files = [getattr(module, "__file__", None) for module in list(sys.modules.values())
                 if getattr(module, "__file__", None) != os.path.abspath(__file__)]
        ours = [os.path.relpath(f, ROOT) for f in files if f and os.path.isabs(f) and f.startswith(ROOT + os.sep)]
        with open(report, "w") as f:
            json.dump([p for p in ours if p != os.path.relpath(path, ROOT)], f)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reading_order():
    """[(path, lines)] of every file a 2-step pretraining run loads (its second run: the token cache read, not built),
    breadth first from the entry script in the order each file names its imports; files no import names in that walk
    (package __init__ files) last."""
    loaded = dict(pretraining_loads()[1])
    order, queue = [], ["trainer.train_pretrain"]
    while queue:
        name = queue.pop(0)
        path = os.path.relpath(module_path(name), ROOT)
        if path in order or path not in loaded:
            continue
        order.append(path)
        queue.extend(imports_in_order(module_path(name)))
    return [(path, loaded[path]) for path in order] + [(p, n) for p, n in loaded.items() if p not in order]


def reading_block():
    rows = reading_order()
    lines = [READ_BEGIN, "", step_block(), "", "### Everything a pretraining run loads", "",
             f"Pretraining's reading path: {len(rows)} files, {sum(n for _, n in rows)} lines: what a "
             "2-step run of `python trainer/train_pretrain.py` loads (its `sys.modules`, package __init__ files "
             "included; scripts/module_map.py loaded_files), breadth first from the entry script; a dimension, an "
             "optimizer of its own, a sink or a stage helper is read only when a flag asks for it:", ""]
    lines += [" -> ".join(f"{path} ({n})" for path, n in rows[i:i + 4]) + ("" if i + 4 >= len(rows) else " ->")
              for i in range(0, len(rows), 4)]
    return "\n".join(lines + ["", READ_END])


def replace_block(text, begin, end, block):
    start, stop = text.find(begin), text.find(end)
    return text[:start] + block + text[stop + len(end):] if start >= 0 else text.rstrip() + "\n\n" + block + "\n"


def main(argv):
    if "--loaded" in argv[:1]:
        return _measure([tuple(job) for job in json.loads(argv[1])])
    if "--loads" in argv[:1]:  # the figures: files and lines of the first and the second 2-step run
        for name, rows in zip(("first run", "second run"), pretraining_loads()):
            print(f"{name}: {len(rows)} files, {sum(n for _, n in rows)} lines")
        return 0
    text = module_map()
    if "--write" not in argv:
        print(reading_block() + "\n\n" + text)
        return 0
    path = os.path.join(ROOT, "docs", "design.md")
    design = replace_block(open(path).read(), BEGIN, END, text)
    design = replace_block(design, READ_BEGIN, READ_END, reading_block())
    with open(path, "w") as f:
        f.write(design)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
