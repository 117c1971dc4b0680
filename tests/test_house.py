"""The folder tree is the map: the import direction between trainer/'s folders, no module at trainer/'s top but the
entry scripts and trainer_utils.py, no function over 60 lines, every folder described, and every module README.md and
docs/ name exists (and every folder and module is named in the map: README lists the folders, docs/design.md the
modules)."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("core", "plan", "ckpt", "runtime", "stages", "rl", "parallel")
# folder -> the trainer folders it must never import (the layering of docs/design.md, "Layout")
FORBIDDEN = {
    "core": ("stages", "rl"),
    "plan": ("stages", "rl"),
    "ckpt": ("core", "stages", "rl"),
    "runtime": ("core", "stages", "rl"),
    "parallel": ("core", "plan", "ckpt", "stages", "rl"),
    "stages": ("rl",),
    "rl": (),
}


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
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def relative(path):
    return os.path.relpath(path, ROOT)


def test_imports_follow_the_layering():
    broken = []
    for path in python_files("trainer", "model", "dataset"):
        where = relative(path).split(os.sep)
        for name in set(imported_modules(path)):
            parts = name.split(".")
            if parts[0] == "trainer" and where[0] in ("model", "dataset"):
                broken.append(f"{relative(path)} imports {name}: model/ and dataset/ know nothing of the trainer")
            if parts[0] != "trainer" or len(parts) < 2:
                continue
            if parts[1].startswith("train_") and not where[-1].startswith("train_"):
                broken.append(f"{relative(path)} imports the entry script {name}")
            if len(where) == 3 and parts[1] in FORBIDDEN.get(where[1], ()):
                broken.append(f"{relative(path)} imports {name}: {where[1]}/ sits below {parts[1]}/")
            if len(where) == 3 and where[1] in ("stages", "rl") and name.startswith("trainer.core.loop"):
                broken.append(f"{relative(path)} imports the loop: stages import core's helpers, never the loop")
    assert broken == [], "\n".join(broken)


def test_layering_check_sees_a_violation(tmp_path):
    """The check above reads imports from source: a forbidden one written in a file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from trainer.rl.grpo import GRPOPlan\nimport trainer.core.loop\n")
    assert {"trainer.rl.grpo", "trainer.rl.grpo.GRPOPlan", "trainer.core.loop"} <= set(imported_modules(bad))


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


def test_no_function_over_60_lines():
    long = []
    for path in python_files("trainer"):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{relative(path)}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def docs():
    paths = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", n)
                                                  for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                  if n.endswith(".md")]
    return {relative(p): open(p).read() for p in paths}


PATH_MENTION = re.compile(r"(?<![\w/.-])((?:trainer|model|dataset|scripts|tests)/[\w/]*\w\.(?:py|sh))\b")
# a module named by path then attribute, `trainer/ckpt/checkpointer.Checkpointer`, or a folder, `trainer/parallel/`
MODULE_MENTION = re.compile(r"`((?:trainer|model|dataset|scripts)/[\w/]*\w)(?=[.:/`])(?!\.(?:jsonl|parquet|json)\b)")
DOTTED_MENTION = re.compile(r"`(trainer(?:\.\w+)+)`")


def test_every_module_the_docs_name_exists():
    missing = []
    for doc, text in docs().items():
        for path in set(PATH_MENTION.findall(text)):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc} names {path}")
        for path in set(MODULE_MENTION.findall(text)):
            full = os.path.join(ROOT, path)
            if not any(os.path.exists(full + end) for end in ("", ".py", ".sh", ".json")):
                missing.append(f"{doc} names {path}")
        for dotted in set(DOTTED_MENTION.findall(text)):
            parts = dotted.split(".")
            candidates = [os.path.join(ROOT, *parts[:k]) for k in range(len(parts), 1, -1)]
            if not any(os.path.exists(c + ".py") or os.path.isdir(c) for c in candidates):
                missing.append(f"{doc} names {dotted}")
    assert missing == [], "\n".join(sorted(missing))


def test_docs_check_sees_a_missing_module():
    assert PATH_MENTION.findall("see trainer/core/loop.py and trainer/nothing_here.py.") == [
        "trainer/core/loop.py", "trainer/nothing_here.py"]
    assert MODULE_MENTION.findall("`trainer/dpo_reference.read_cache`, `trainer/parallel/`, `dataset/rlaif.jsonl`") == [
        "trainer/dpo_reference", "trainer/parallel"]


def test_the_map_names_every_folder_and_module():
    """README lists trainer's folders (one line each); docs/design.md's module map names every module."""
    readme, design = docs()["README.md"], docs()[os.path.join("docs", "design.md")]
    assert [f for f in FOLDERS if f"trainer/{f}/" not in readme] == []
    modules = [relative(p) for p in python_files("trainer", "model", "dataset", "scripts")
               if not p.endswith("__init__.py")]
    assert [m for m in modules if m not in design] == []
