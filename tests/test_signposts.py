"""Signposts that stay true: what the docstrings and comments of trainer/, model/, dataset/, scripts/ and tests/, the
requirements files' comments, and the lines of README.md and docs/, name exists; flag help texts do not deny what the
checks accept; the wrap order is stated once, as the code runs it.

The rule, kept narrow so that every hit is a real stale mention (each text is a docstring line or a `#` comment):
- a path `a/b/c.py` (or .sh, .md) whose first folder is one of this repository's (trainer, model, dataset, scripts,
  tests, docs, or a folder inside trainer/ or scripts/): the file exists relative to the repository root, trainer/,
  the mentioning file's folder or the folder above it; placeholders (`train_<stage>.py`) are not paths;
- a path then an attribute, `trainer/ckpt/resume.read_checkpoint_record`: that module exists (as above) and
  defines the name (a def, class, assignment, import or argument anywhere in it);
- a dotted module, `trainer.ckpt.checkpointer.Checkpointer`: when its second part is a real module or package (else it
  is an object's attribute: `model.layers`), the modules resolve and the first name after them is defined there;
- a bare module then a constant or a class, `shapes.FIXES`, `schema.Flag`: when the stem names exactly one
  module of these folders, that module defines it (lower-case attributes are left alone: `engine.generate`,
  `schedule.eval` are objects' methods);
- a bare file name `loop.py`: some file of the repository has that name, unless its stem is upper case (a
  placeholder: `FILE.py:NAME`) or another project's possessive precedes it (llama.cpp's convert_hf_to_gguf.py).
After a move, run `python -m pytest -q tests/test_signposts.py`: each stale mention is one line, file:line -> target.
"""
import argparse
import ast
import io
import os
import re
import tokenize
from collections import Counter

import pytest

from model.model_minimind import MiniMindConfig
from trainer.parallel import parallelize
from trainer.parallel.expert import validate as check_expert_parallel  # ep's check (mesh.DIMENSIONS)
from trainer.plan.sections import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("trainer", "model", "dataset", "scripts", "tests")
REQUIREMENTS = ("requirements.txt", "requirements-llama.txt")  # their comments name modules too
EXTENSIONS = {"py", "sh", "md", "json", "jsonl", "pth", "bin", "parquet", "txt", "safetensors", "gguf", "yaml", "yml",
              "toml", "log", "csv", "html", "png", "err", "out", "pt", "npy", "lock", "cfg", "ini", "idx", "gz", "zip"}
PATH = re.compile(r"(?<![\w/.<>$-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|sh|md))\b")
PATH_ATTR = re.compile(r"(?<![\w/.<>$-])((?:[A-Za-z_][\w-]*/)+\w+)\.([A-Za-z_]\w*)\b")
DOTTED = re.compile(r"(?<![\w/.])((?:trainer|model|dataset|scripts|tests)(?:\.[A-Za-z_]\w*)+)")
BARE_ATTR = re.compile(r"(?<![\w/.])([a-z_]\w*)\.([A-Z]\w*)\b")
BARE_FILE = re.compile(r"(?<![\w/.<>$-])(?:(\S+)'s? )?(\w+\.py)\b")


def python_files():
    for folder in SOURCES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))


def texts(source):
    """(line number, text) of every docstring line and `#` comment of a module's source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                for i, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + i, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def defined_names(path, cache={}):
    """Every name `path` defines anywhere: defs, classes, assigned names and attributes, imports, arguments."""
    if path not in cache:
        names = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
        cache[path] = names
    return cache[path]


class Repo:
    """What exists: the repository's folders, file names and module stems (read once)."""

    def __init__(self, root=ROOT):
        self.root = root
        self.folders = set(SOURCES) | {"docs"}
        for top in ("trainer", "scripts"):
            full = os.path.join(root, top)
            self.folders |= {n for n in os.listdir(full) if os.path.isdir(os.path.join(full, n)) and n[0] != "_"}
        self.file_names = set()
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            self.file_names.update(names)
        self.modules = {}  # stem -> its file, for the stems that name exactly one module
        stems = Counter()
        for path in python_files():
            stem = os.path.basename(path)[:-3]
            if stem != "__init__":
                stems[stem] += 1
                self.modules[stem] = path
        self.modules = {s: p for s, p in self.modules.items() if stems[s] == 1}

    def bases(self, path):
        here = os.path.dirname(path)
        return (self.root, os.path.join(self.root, "trainer"), here, os.path.dirname(here))

    def find(self, path, mention, end=""):
        return next((os.path.join(b, mention + end) for b in self.bases(path)
                     if os.path.exists(os.path.join(b, mention + end))), None)

    def module_file(self, parts):
        full = os.path.join(self.root, *parts)
        return full + ".py" if os.path.isfile(full + ".py") else os.path.join(full, "__init__.py")


def stale_mentions(path, text, repo):
    """The targets `text` (a docstring line or comment of `path`) names that do not exist, each with why."""
    stale = []
    for mention in PATH.findall(text):
        if mention.split("/")[0] in repo.folders and not repo.find(path, mention):
            stale.append(f"{mention} (no such file)")
    for module, attr in PATH_ATTR.findall(text):
        if attr in EXTENSIONS or module.split("/")[0] not in repo.folders:
            continue
        found = repo.find(path, module, ".py")
        if found is None and not repo.find(path, module):
            stale.append(f"{module}.{attr} (no module {module}.py)")
        elif found is not None and attr not in defined_names(found):
            stale.append(f"{module}.{attr} ({module}.py defines no {attr})")
    for dotted in DOTTED.findall(text):
        parts = dotted.split(".")
        depth = 1
        while depth < len(parts) and (os.path.isfile(os.path.join(repo.root, *parts[:depth + 1]) + ".py")
                                      or os.path.isdir(os.path.join(repo.root, *parts[:depth + 1]))):
            depth += 1
        if 1 < depth < len(parts) and parts[depth] not in EXTENSIONS:
            module = repo.module_file(parts[:depth])
            if not os.path.isfile(module) or parts[depth] not in defined_names(module):
                stale.append(f"{dotted} ({'.'.join(parts[:depth])} defines no {parts[depth]})")
    for stem, attr in BARE_ATTR.findall(text):
        if stem in repo.modules and attr not in EXTENSIONS and attr not in defined_names(repo.modules[stem]):
            stale.append(f"{stem}.{attr} ({os.path.relpath(repo.modules[stem], repo.root)} defines no {attr})")
    for owner, name in BARE_FILE.findall(text):
        if name not in repo.file_names and not name[:-3].isupper() and not owner:
            stale.append(f"{name} (no file of that name)")
    return stale


def requirement_texts(path):
    """(line number, comment) of a requirements file: its comments say which module needs a package."""
    with open(path) as f:
        return [(i, line.split("#", 1)[1]) for i, line in enumerate(f, 1) if "#" in line]


def all_stale(repo):
    found = []
    requirements = [os.path.join(repo.root, name) for name in REQUIREMENTS]
    for path in [*python_files(), *requirements]:
        lines = requirement_texts(path) if path in requirements else texts(open(path).read())
        for line, text in lines:
            found += [f"{os.path.relpath(path, repo.root)}:{line} -> {s}" for s in stale_mentions(path, text, repo)]
    return found


def test_every_signpost_names_something_that_exists():
    stale = all_stale(Repo())
    assert stale == [], "stale mentions in docstrings and comments (file:line -> missing target):\n" + "\n".join(stale)


def test_the_check_sees_each_kind_of_stale_mention(tmp_path):
    """Each rule on a written module, against the answer worked out by hand: true mentions pass, stale ones are named
    once each, placeholders and objects' attributes are left alone."""
    repo = Repo()
    here = os.path.join(ROOT, "trainer", "core", "loop.py")
    text = ("trainer/core/loop.py, ckpt/resume.py, trainer/ckpt/resume.read_checkpoint_record, "
            "trainer.ckpt.checkpointer.Checkpointer, shapes.FIXES, loop.py, train_<stage>.py, FILE.py:NAME, "
            "model.layers, engine.generate, llama.cpp's convert_hf_to_gguf.py, out/pretrain_768.pth; stale: "
            "trainer/expert_load.py, trainer/schema.Flag, trainer/ckpt/resume.no_such_reader, "
            "trainer.ckpt.resume.NoSuchClass, shapes.NO_FIXES, progress.py")
    assert stale_mentions(here, text, repo) == [
        "trainer/expert_load.py (no such file)",
        "trainer/schema.Flag (no module trainer/schema.py)",
        "trainer/ckpt/resume.no_such_reader (trainer/ckpt/resume.py defines no no_such_reader)",
        "trainer.ckpt.resume.NoSuchClass (trainer.ckpt.resume defines no NoSuchClass)",
        "shapes.NO_FIXES (model/weights/shapes.py defines no NO_FIXES)",
        "progress.py (no file of that name)"]
    module = tmp_path / "m.py"
    module.write_text('"""Reads trainer/nothing.py."""\nx = 1  # see trainer/core/loop.py and nowhere.py\n')
    assert [(n, stale_mentions(str(module), t, repo)) for n, t in texts(module.read_text())] == [
        (1, ["trainer/nothing.py (no such file)"]), (2, ["nowhere.py (no file of that name)"])]


# in the docs, a module or folder named in backticks without an attribute: `trainer/parallel/`, `trainer/core/loop`
DOC_MODULE = re.compile(r"`((?:trainer|model|dataset|scripts)/[\w/]*\w)(?=[.:/`])(?!\.(?:jsonl|parquet|json)\b)")


def doc_files(root=ROOT):
    return [os.path.join(root, "README.md")] + [os.path.join(root, "docs", n)
                                                for n in sorted(os.listdir(os.path.join(root, "docs")))
                                                if n.endswith(".md")]


def stale_doc_mentions(path, text, repo):
    """The targets a line of README.md or docs/ names that do not exist: the docstring rules above (a module then an
    attribute resolves the attribute), and a module or folder in backticks."""
    stale = stale_mentions(path, text, repo)
    for mention in DOC_MODULE.findall(text):
        full = os.path.join(repo.root, mention)
        if not any(os.path.exists(full + end) for end in ("", ".py", ".sh", ".json")):
            stale.append(f"{mention} (no such module or folder)")
    return stale


def test_every_doc_mention_names_something_that_exists():
    repo, stale = Repo(), []
    for path in doc_files():
        for number, line in enumerate(open(path), 1):
            stale += [f"{os.path.relpath(path, ROOT)}:{number} -> {s}" for s in stale_doc_mentions(path, line, repo)]
    assert stale == [], "stale mentions in README.md and docs/ (file:line -> missing target):\n" + "\n".join(stale)


def test_the_doc_check_resolves_the_attribute(tmp_path):
    """A doc naming a module's attribute goes stale when the attribute moves or is renamed, the module staying: the
    claims issue #56 found in docs/design.md are named, their corrections pass; and on a written tree, the same line
    passes before a function's rename and is named after it."""
    design = os.path.join(ROOT, "docs", "design.md")
    text = ("`trainer/ckpt/resume.Checkpointer.save`, `trainer/ckpt/resume.best_checkpoint_step`; "
            "`trainer/ckpt/checkpointer.Checkpointer.save`, `trainer/ckpt/step_dirs.best_checkpoint_step`, "
            "`trainer/parallel/`, `trainer/core/loop`, `trainer/nowhere/`")
    assert stale_doc_mentions(design, text, Repo()) == [
        "trainer/ckpt/resume.Checkpointer (trainer/ckpt/resume.py defines no Checkpointer)",
        "trainer/ckpt/resume.best_checkpoint_step (trainer/ckpt/resume.py defines no best_checkpoint_step)",
        "trainer/nowhere (no such module or folder)"]
    line = "the run's state is read by `trainer/ckpt/state.read_state` (see trainer/ckpt/state.py)"
    found = []
    for version, function in (("before", "read_state"), ("after", "read_run_state")):
        for folder in ("trainer/ckpt", "scripts", "docs"):
            os.makedirs(tmp_path / version / folder)
        (tmp_path / version / "trainer" / "ckpt" / "state.py").write_text(f"def {function}(path):\n    return path\n")
        repo = Repo(str(tmp_path / version))
        found.append(stale_doc_mentions(str(tmp_path / version / "docs" / "design.md"), line, repo))
    assert found == [[], ["trainer/ckpt/state.read_state (trainer/ckpt/state.py defines no read_state)"]]


ORDER_STATEMENT = re.compile(r"\b(?:pp|tp|cp|ep|dp)(?: split)? -> (?:pp|tp|cp|ep|dp)\b")
STEPS = {"pipeline split": "Pipeline", "tensor parallel": "apply_tensor_parallel",
         "expert parallel": "apply_expert_parallel", "context parallel": "apply_context_parallel",
         "activation checkpointing": "apply_activation_checkpointing", "compile": "compile_blocks",
         "data parallel": "apply_data_parallel"}


def callee(call):
    """The called function's own name: f(...) -> f, module.f(...) or used["tp"].f(...) -> f."""
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def test_the_wrap_order_is_stated_once_as_the_code_runs_it():
    """parallelize.py's docstring states the order; its function calls the steps in that order; no other docstring or
    comment states an order of its own (they point at parallelize.py)."""
    source = open(parallelize.__file__).read()
    stated = re.search(r"Order: (.+?)\.\s", " ".join(ast.get_docstring(ast.parse(source)).split())).group(1)
    stated = [step.split(" (")[0].strip() for step in stated.split("->")]
    assert len(stated) == len(STEPS) and set(stated) == set(STEPS), stated
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "parallelize")
    # a step is called by name or through its dimension's module (used["tp"].apply_tensor_parallel)
    calls = [(callee(node), node.lineno) for node in ast.walk(function)
             if isinstance(node, ast.Call) and callee(node) in STEPS.values()]
    first_line = {name: min(line for callee_name, line in calls if callee_name == name) for name, _ in calls}
    assert sorted(first_line, key=first_line.get) == [STEPS[step] for step in stated]
    others = [f"{os.path.relpath(p, ROOT)}:{line}: {text.strip()}" for p in python_files()
              if p != parallelize.__file__ for line, text in texts(open(p).read()) if ORDER_STATEMENT.search(text)]
    assert others == [], "wrap orders stated outside trainer/parallel/parallelize.py:\n" + "\n".join(others)


DENIAL = re.compile(r"\b(?:no|without|not with) (?:--)?((?:tp|pp|cp|ep)(?:/(?:tp|pp|cp|ep))*)\b")


def test_dimension_help_texts_deny_nothing_the_checks_accept():
    """A layout flag's help that says it does not compose with another dimension must match a check that refuses
    the pair: --ep's help once said "no tp/pp/cp so far" while ep's check (parallel/expert.py validate) accepts
    all three."""
    helps = {name: field.metadata.get("help", "") for name, field in Layout.__dataclass_fields__.items()
             if name in ("tp", "pp", "cp", "ep")}
    assert set(helps) == {"tp", "pp", "cp", "ep"}
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4)
    contradictions = []
    for flag, text in helps.items():
        for group in DENIAL.findall(text):
            for other in group.split("/"):
                sizes = {**dict(tp=1, pp=1, cp=1, ep=1), flag: 2, other: 2}
                args = argparse.Namespace(**sizes, cpu_offload=0, check_replicas=0)
                if check_expert_parallel(args, config, zero_stage=0):
                    continue
                contradictions.append(f"--{flag}'s help denies --{other}, which the checks accept")
    assert contradictions == []


@pytest.mark.parametrize("other", ["tp", "pp", "cp"])
def test_ep_composes_with_each_dimension(other):
    """The reference for the help check above: ep's check (parallel/expert.py validate) accepts --ep 2 with each other
    dimension at 2, and refuses --ep 2 with ZeRO-1 (so a denial there would be true)."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4)
    args = argparse.Namespace(**{**dict(tp=1, pp=1, cp=1, ep=2), other: 2}, cpu_offload=0, check_replicas=0)
    assert check_expert_parallel(args, config, zero_stage=0) is None
    assert "zero_stage 1" in check_expert_parallel(args, config, zero_stage=1)
    # the help test reads a denial where one is written: the old --ep help
    assert DENIAL.findall("must divide the dp size (--zero_stage 0/2/3, no tp/pp/cp so far)") == ["tp/pp/cp"]
