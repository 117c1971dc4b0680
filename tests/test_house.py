"""The folder tree is the map: the import direction between trainer/'s folders, no module at trainer/'s top but the
entry scripts and trainer_utils.py, no function over 60 lines, every folder described and named in the map (README
lists the folders, docs/design.md the modules; that what the docs name exists is tests/test_signposts.py's), and what a
pretraining run loads (scripts/module_map.py's measure) stays short."""
import ast
import importlib.util
import os
import re

import pytest

from scripts.module_map import STEP_FIRST, from_module, pretraining_loads, step_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the floors, bottom first (docs/design.md, "Floors"): each imports only the floors below it, no exceptions; model/ and
# dataset/ sit under the trainer; the top floor is trainer/'s entry scripts and trainer_utils.py
FLOORS = ("model", "dataset", "base", "parallel", "ckpt", "judge", "observe", "runtime", "plan", "core", "stages", "rl",
          "top")
FOLDERS = FLOORS[2:-1]
PROJECT = ("trainer", "model", "dataset", "scripts")


def python_files(*folders):
    for folder in folders:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))


def imported_modules(path):
    """Every module `path` imports, absolute names ("trainer.core.loop"), from the source."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and from_module(node, path):  # a relative one resolved
            yield from_module(node, path)
            yield from (f"{from_module(node, path)}.{alias.name}" for alias in node.names)


def relative(path):
    return os.path.relpath(path, ROOT)


def floor_of(path):
    """The floor of a file under trainer/, model/ or dataset/ (FLOORS)."""
    where = relative(path).split(os.sep)
    if where[0] != "trainer":
        return where[0]
    return where[1] if len(where) == 3 else "top"


def module_files():
    """{dotted module name: path} of every module in trainer/, model/ and dataset/ (a package by its own name)."""
    files = {}
    for path in python_files("trainer", "model", "dataset"):
        name = relative(path)[:-3].replace(os.sep, ".")
        files[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return files


def import_graph():
    """{module: the project modules it imports}, from the source, imports inside functions included."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        found = set()
        for imported in imported_modules(path):
            parts = imported.split(".")
            found.update(next(([".".join(parts[:k])] for k in range(len(parts), 0, -1)
                               if ".".join(parts[:k]) in files), []))
        graph[name] = found - {name}
    return graph, files


def test_imports_follow_the_floors():
    """Each floor imports only the floors below it (a package's __init__ belongs to no floor: it imports nothing)."""
    graph, files = import_graph()
    broken = []
    for name, imported in graph.items():
        if files[name].endswith("__init__.py"):
            continue
        for other in imported:
            if files[other].endswith("__init__.py"):
                continue
            here, there = floor_of(files[name]), floor_of(files[other])
            if there == "top" and here == "top" and not os.path.basename(files[name]).startswith("train_"):
                broken.append(f"{relative(files[name])} imports {other}: only an entry script imports an entry script")
            elif FLOORS.index(there) > FLOORS.index(here):
                broken.append(f"{relative(files[name])} imports {other}: {here}/ sits below {there}/")
            if here in ("stages", "rl") and other == "trainer.core.loop":
                broken.append(f"{relative(files[name])} imports the loop: stages import core's helpers, never the loop")
    assert broken == [], "\n".join(sorted(broken))


def cycles(graph):
    """The import cycles of `graph` (strongly connected components of more than one module), Tarjan's algorithm."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_files():
    graph, _ = import_graph()
    assert cycles(graph) == []


# what a real 2-step pretraining run loads (scripts/module_map.py pretraining_loads: its sys.modules, package __init__
# files included, the entry script too), its second run (the token cache read, not built): before issue #56, whose
# measure this is, 67 files / 8,155 lines (the static closure then counted 59 / 8,133, without most __init__ files and
# blind to the 14 modules imported by a string constant); a dimension, the MoE loads, lm-eval scoring, PowerSGD, HF
# folders, the report and the agent's tools are read by the runs that use them only. Issue #56's splits (observe/, the
# guard in three, the HealthWatch callback in observe/): 71 / 8,169; the string imports made function-level imports
# (the same files load) and the re-exports removed: 71 / 8,151; merged with the model's vocab_size from its tokenizer,
# the small-corpus line, the chat rows' cache format (issue #58) and the loader's collate that cuts a micro-batch to
# its longest row (issue #55): 71 / 8,293. Issue #56's second part: the MoE layer and YaRN out of the model file (read
# by the models that use them), the weights modules a package of their own (its __init__ the one file more), resume,
# room, MoE set-up, the data's lines and the clip moved to their owners: 72 / 8,155; one flag declaration style (each
# section field beside its Flag in FLAGS, +49 lines in sections.py and schema.py) and --optimizer a resume field:
# 72 / 8,204; the document mask reads branches, position ids stepping back to p > 0 (a prompt run once for several
# answers, prefix_tree in the model): 72 / 8,224; issue #55's third round (short rows' attention in fp32 under CPU bf16
# autocast, the heap trimmed by growth, start-up's objects frozen out of the collector during the loop, the lm_head on
# the positions with a target): 72 / 8,277; issue #55's fourth round (decoding: one token's attention in fp32 under CPU
# bf16 autocast in the model, oneDNN's packed linear listed in model/torch_compat.py with the other private calls):
# 72 / 8,326.
PRETRAIN_FILES, PRETRAIN_LINES = 72, 8326


def test_pretraining_reads_a_short_path(capsys):
    """The files a 2-step pretraining run loads stay under the bound; a first run (the token cache built) loads the
    token cache's build, dataset/tokenizing/, on top and nothing else."""
    first, second = pretraining_loads()
    with capsys.disabled():
        for name, rows in (("first", first), ("second", second)):
            print(f"\npretraining's {name} 2-step run loads {len(rows)} files, {sum(n for _, n in rows)} lines")
    assert len(second) <= PRETRAIN_FILES and sum(n for _, n in second) <= PRETRAIN_LINES, second
    assert {p for p, _ in second} <= {p for p, _ in first}
    assert {p for p, _ in first} - {p for p, _ in second} == {relative(p) for p in python_files("dataset/tokenizing")}


# issue #56: the files that explain one optimizer step (scripts/module_map.py STEP_FIRST), at most 12 files and 2,500
# lines; when it was set, 12 files / 1,886 lines (the model 641 of them, its MoE layer and YaRN in files of their own)
STEP_FILES, STEP_LINES = 12, 2500


def test_the_step_first_block_is_short_and_is_what_a_run_runs(capsys):
    """Each file of the step-first block is one a real 2-step pretraining run loads, none twice, and the block stays
    within STEP_FILES files and STEP_LINES lines."""
    loaded = dict(pretraining_loads()[1])
    paths = [path for path, _ in STEP_FIRST]
    assert [p for p in paths if p not in loaded] == [] and len(set(paths)) == len(paths)
    lines = sum(loaded[p] for p in paths)
    with capsys.disabled():
        print(f"\nthe step-first block: {len(paths)} files, {lines} lines")
    assert len(paths) <= STEP_FILES and lines <= STEP_LINES, (len(paths), lines)


def test_design_opens_with_one_step_then_pretrainings_reading_order():
    """docs/design.md opens (scripts/module_map.py --write) with the step-first block as STEP_FIRST has it today (its
    files in order, their current lines), then every file a run loads."""
    design = docs()[os.path.join("docs", "design.md")]
    start, stop = design.find("<!-- reading order: begin"), design.find("<!-- reading order: end -->")
    assert 0 <= start < design.find("\n## "), "docs/design.md opens with the reading order for pretraining"
    assert step_block() in design[start:stop], "the step-first block is stale: python scripts/module_map.py --write"
    listed = set(re.findall(r"((?:trainer|model|dataset)/[\w/]+\.py) \(\d+\)", design[start:stop]))
    assert listed == {path for path, _ in pretraining_loads()[1]}


# scripts/convert_model.py ships this file, and the files it imports relatively, as a MiniMind folder's remote code
REMOTE_CODE = "model/model_minimind.py"


def test_relative_imports_only_where_remote_code_needs_them():
    """A relative import appears only in the files an export ships as remote code (model/model_minimind.py and what it
    imports relatively, found as transformers finds them: the MoE layer and YaRN, read only by the models that use
    them); every other file imports absolutely."""
    from transformers.dynamic_module_utils import get_relative_import_files
    shipped = {REMOTE_CODE} | {relative(p) for p in get_relative_import_files(os.path.join(ROOT, REMOTE_CODE))}
    found = {relative(path) for path in python_files(*PROJECT) for node in ast.walk(ast.parse(open(path).read()))
             if isinstance(node, ast.ImportFrom) and node.level > 0}
    assert found <= shipped and {"model/moe.py", "model/yarn.py"} <= shipped, found


def test_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def string_imports(path):
    """(the enclosing function, or "<module>", line) of every call in `path` that imports a module by a string:
    importlib.import_module, __import__."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and (getattr(child.func, "attr", None) == "import_module"
                                                or getattr(child.func, "id", None) in ("import_module", "__import__")):
                found.append((function, child.lineno))
            visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)
    visit(ast.parse(open(path).read()), "<module>")
    return found


def registries():
    """The tables whose entries name a module, imported by that name when an entry is used (the one way a module is
    imported by a string): {(file, the function that imports): the entries' modules}."""
    from scripts.planner.fit import ENTRY_SCRIPTS
    from trainer.parallel.mesh import DIMENSIONS
    from trainer.runtime.optimizer_choice import OPTIMIZERS
    return {("trainer/parallel/mesh.py", "dimension_module"): [d.module for d in DIMENSIONS],
            ("trainer/runtime/optimizer_choice.py", "kwargs"): [entry.module for entry in OPTIMIZERS.values()],
            ("scripts/planner/fit.py", "script_stage"): list(ENTRY_SCRIPTS.values())}


def test_no_module_is_imported_by_a_string_outside_a_registry():
    """A part loaded when used is an ordinary import inside the function that needs it, which ruff, an IDE, the floors
    test and an import graph all see; a string names a module only in a registry's entries (checked below)."""
    found = [(relative(path).replace(os.sep, "/"), function, line)
             for path in python_files("trainer", "model", "dataset", "scripts")
             for function, line in string_imports(path)]
    assert [f"{path}:{line} ({function})" for path, function, line in found
            if (path, function) not in registries()] == []
    assert {(path, function) for path, function, _ in found} == set(registries())  # the check saw each registry


def test_registry_entries_are_modules_on_allowed_floors():
    """Each registry entry names a module that exists: a third-party one, or a project module on the registry's floor
    or below it (a command of scripts/ may name the trainer's entry scripts: its floors are above them all)."""
    files, problems = module_files(), []
    for (holder, _), modules in registries().items():
        for module in modules:
            if module.split(".")[0] not in ("trainer", "model", "dataset"):
                if importlib.util.find_spec(module) is None:
                    problems.append(f"{holder} names {module}, which is not installed")
            elif module not in files:
                problems.append(f"{holder} names {module}, which does not exist")
            elif not holder.startswith("scripts/") and \
                    FLOORS.index(floor_of(files[module])) > FLOORS.index(floor_of(os.path.join(ROOT, holder))):
                problems.append(f"{holder} names {module}, on a floor above its own")
    assert problems == []
    assert sum(map(len, registries().values())) >= 5 + 5 + 11  # dimensions, optimizers, stages: the check saw them


def test_string_import_check_sees_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import importlib\nA = importlib.import_module('trainer.core.loop')\n\n\ndef f(name):\n"
                      "    def g():\n        return __import__(name)\n    return g\n")
    assert string_imports(module) == [("<module>", 2), ("g", 7)]


def test_floor_check_sees_a_violation(tmp_path):
    """The floor check reads imports from source: an upward one written in a file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from trainer.rl.grpo import GRPOPlan\nimport trainer.core.loop\n")
    assert {"trainer.rl.grpo", "trainer.rl.grpo.GRPOPlan", "trainer.core.loop"} <= set(imported_modules(bad))
    assert FLOORS.index("rl") > FLOORS.index("ckpt")


def test_scripts_import_no_entry_script_nor_trainer_utils():
    """Nothing imports the top floor but an entry script (the floors test, for trainer/); scripts/ imports neither an
    entry script nor trainer_utils.py, whose MiniMind names point at their homes (the path rule:
    model/weights/paths.py); the planner reads an entry script's defaults through its registry (ENTRY_SCRIPTS, checked
    above)."""
    top = {n[:-3] for n in os.listdir(os.path.join(ROOT, "trainer")) if n.endswith(".py") and n != "__init__.py"}
    found = {f"{relative(path)} imports {name}" for path in python_files("scripts") for name in imported_modules(path)
             if name.split(".")[0] == "trainer" and len(name.split(".")) > 1 and name.split(".")[1] in top}
    assert sorted(found) == []


def reexports(path):
    """The project imports of `path` kept for others to import from here (marked `noqa: F401`): (line, module)."""
    lines = open(path).read().splitlines()
    return [(node.lineno, node.module) for node in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT
            and any("noqa: F401" in line for line in lines[node.lineno - 1:node.end_lineno])]


def test_each_name_has_one_home():
    """No module re-exports a project name: an importer names the module that defines it (trainer_utils.py's MiniMind
    names, in its __all__, are the one exception: no noqa there either)."""
    found = [f"{relative(path)}:{line} re-exports from {module}"
             for path in python_files("trainer", "model", "dataset", "scripts") for line, module in reexports(path)]
    assert found == []


def test_reexport_check_sees_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch  # noqa: F401\nfrom trainer.ckpt.step_dirs import (\n    MANIFEST,\n"
                      "    latest_checkpoint,  # noqa: F401 (re-exported)\n)\nfrom model.errors import ConfigError\n")
    assert reexports(module) == [(2, "trainer.ckpt.step_dirs")]


def test_trainer_top_level_holds_entry_scripts_only():
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "trainer")) if n.endswith(".py"))
    stray = [n for n in top if not (n.startswith("train_") or n in ("trainer_utils.py", "__init__.py"))]
    assert stray == [], f"modules at trainer/'s top level (move them into a folder): {stray}"
    folders = sorted(n for n in os.listdir(os.path.join(ROOT, "trainer"))
                     if os.path.isdir(os.path.join(ROOT, "trainer", n)) and not n.startswith("__"))
    assert folders == sorted(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_folder_says_what_lives_there(folder):
    init = os.path.join(ROOT, "trainer", folder, "__init__.py")
    doc = ast.get_docstring(ast.parse(open(init).read()))
    assert doc and "import" in doc, f"trainer/{folder}/__init__.py: a docstring: what lives there, what it imports"


BELOW_TRAINER = ["model", "model/export", "model/weights", "dataset", "dataset/demo", "dataset/tokenizing"]


@pytest.mark.parametrize("folder", [f"trainer/{f}" for f in FOLDERS] + BELOW_TRAINER)
def test_no_folder_holds_more_than_12_modules(folder):
    names = [n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py") and n != "__init__.py"]
    assert len(names) <= 12, f"{folder}/ holds {len(names)} modules: split it by concern"


def test_no_function_over_60_lines():
    long = []
    for path in python_files("trainer", "model", "dataset", "scripts"):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{relative(path)}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def docs():
    paths = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", n)
                                                  for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                  if n.endswith(".md")]
    return {relative(p): open(p).read() for p in paths}


def test_the_map_names_every_folder_and_module():
    """README lists trainer's folders (one line each); docs/design.md's module map names every module."""
    readme, design = docs()["README.md"], docs()[os.path.join("docs", "design.md")]
    assert [f for f in FOLDERS if f"trainer/{f}/" not in readme] == []
    modules = [relative(p) for p in python_files("trainer", "model", "dataset", "scripts")
               if not p.endswith("__init__.py")]
    assert [m for m in modules if m not in design] == []
