"""scripts/ as rooms: the inference library (scripts/inference/) and the server (scripts/serve/) import no trainer
module, what a command shares lives in a package (scripts/inference/, scripts/serve/, scripts/benchmarks/,
scripts/planner/) with no `sys.path.insert`, and what each inference command loads is printed (files, lines) so its size
stays seen.

What a command loads is measured as pretraining's is (scripts/module_map.py loaded_files): the repository files in
`sys.modules` of a fresh interpreter after importing the command, package __init__ files included. Before the rooms
(commit 28381a9, scripts/eval_llm.py the inference library) the server reached 67 modules and 10,251 lines, 42 of them
the trainer's (ckpt, plan, runtime among them), by a static count of its top-level imports; with them, 24 modules and
3,326 lines, none the trainer's.
"""
import ast
import os
import sys

import pytest

from scripts.module_map import from_module, loaded_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("scripts/inference", "scripts/serve", "scripts/benchmarks", "scripts/planner", "scripts/curate")
# the packages that run or plan the trainer, and so import it: the benches and the layout planner
TRAINER_USERS = (os.path.join("scripts", "benchmarks"), os.path.join("scripts", "planner"))
# a function may import the trainer's reader of its own format only when the user names such a file
LAZY_ALLOWED = {("scripts/inference/load.py", "trainer.ckpt.resume")}
# every entry script's first import: standard library only (test_prelude_is_standard_library_only), so an inference
# command that reads it reads no trainer code
PRELUDE = {os.path.join("trainer", "__init__.py"), os.path.join("trainer", "base", "__init__.py"),
           os.path.join("trainer", "base", "prelude.py")}


def imports(path, top_level=True):
    """Absolute names `path` imports (module and module.name); only its top-level statements, or only those inside
    functions."""
    tree = ast.parse(open(path).read())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if (id(node) in nested) == top_level:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and from_module(node, path):  # a relative one resolved
            yield from_module(node, path)
            yield from (f"{from_module(node, path)}.{alias.name}" for alias in node.names)


def relative(path):
    return os.path.relpath(path, ROOT)


INFERENCE_COMMANDS = ("scripts/serve_openai_api.py", "scripts/eval_llm.py", "scripts/web_demo.py",
                      "scripts/eval_toolcall.py")
# a written module for the measure's own check: model.errors at its top, trainer.core.loop in a function never called
PROBE = "tests/fixtures/loads_probe.py"


def loads():
    """{script: [(file, lines)]} of what importing each inference command (and PROBE) loads, measured once."""
    found = loaded_files(tuple((script, None) for script in (*INFERENCE_COMMANDS, PROBE)))
    return {script: rows for (script, _), rows in found.items()}


@pytest.mark.parametrize("script", INFERENCE_COMMANDS)
def test_inference_commands_load_no_trainer_module(script, capsys):
    """What Python loads for the command, its sys.modules: of the trainer, only the prelude (standard library)."""
    reached = dict(loads()[script])
    with capsys.disabled():
        print(f"\n{script}: loads {len(reached)} files, {sum(reached.values())} lines")
    trainer = sorted(p for p in reached if p.startswith("trainer" + os.sep))
    assert [p for p in trainer if p not in PRELUDE] == [], f"{script} loads the trainer: {trainer}"
    assert os.path.join("scripts", "inference", "load.py") in reached


def test_the_measure_counts_what_python_loads():
    """The measure on a written module, against the files counted by hand: the module itself, a top-level import and
    the package __init__ it passes through; an import inside a function that never runs loads nothing."""
    assert "trainer.core.loop" in imports(os.path.join(ROOT, PROBE), top_level=False)
    files = ["tests/fixtures/loads_probe.py", "model/__init__.py", "model/errors.py"]
    assert loads()[PROBE] == [(path, len(open(os.path.join(ROOT, path)).read().splitlines())) for path in files]


def package_modules():
    for package in PACKAGES:
        for name in sorted(os.listdir(os.path.join(ROOT, package))):
            if name.endswith(".py"):
                yield os.path.join(ROOT, package, name)


def test_rooms_are_packages_without_path_tricks():
    """Package modules put nothing on sys.path, need no `noqa: E402`, import no entry script of scripts/ and reach the
    trainer inside a function only where LAZY_ALLOWED says; inference and serve import no trainer module at all."""
    top_scripts = {n[:-3] for n in os.listdir(os.path.join(ROOT, "scripts")) if n.endswith(".py")}
    problems = []
    for path in package_modules():
        text = open(path).read()
        if "sys.path.insert" in text or "noqa: E402" in text:
            problems.append(f"{relative(path)} changes sys.path")
        for name in set(imports(path)):
            parts = name.split(".")
            if parts[0] == "scripts" and len(parts) > 1 and parts[1] in top_scripts:
                problems.append(f"{relative(path)} imports the entry script {name}")
            if parts[0] == "trainer" and not relative(path).startswith(TRAINER_USERS):
                problems.append(f"{relative(path)} imports {name}")
        for name in set(imports(path, top_level=False)):
            if name.startswith("trainer") and not any(relative(path) == f and name.startswith(m)
                                                      for f, m in LAZY_ALLOWED):
                problems.append(f"{relative(path)} imports {name} in a function")
    assert problems == []
    assert len(list(package_modules())) >= 20  # inference 4, serve 5, benchmarks 6, planner 5: the check saw them


def test_no_command_imports_another_command():
    """A command script (scripts/*.py) imports no other command: what two commands share lives in a package."""
    commands = {n[:-3] for n in os.listdir(os.path.join(ROOT, "scripts")) if n.endswith(".py")}
    problems = []
    for name in sorted(commands):
        path = os.path.join(ROOT, "scripts", name + ".py")
        for imported in set(imports(path)) | set(imports(path, top_level=False)):
            parts = imported.split(".")
            if parts[0] == "scripts" and len(parts) > 1 and parts[1] in commands - {name}:
                problems.append(f"scripts/{name}.py imports the command {imported}")
    assert problems == []
    assert len(commands) >= 20  # the check saw the commands


def test_prelude_is_standard_library_only():
    """The one trainer module inference commands load (each entry script's first line and signal handlers) imports the
    standard library alone: no torch, nothing of the trainer."""
    path = os.path.join(ROOT, "trainer", "base", "prelude.py")
    names = [*imports(path), *imports(path, top_level=False)]
    assert names and {name.split(".")[0] for name in names} <= set(sys.stdlib_module_names), names
    for init in ("trainer/__init__.py", "trainer/base/__init__.py"):  # the packages it sits in import nothing
        init = os.path.join(ROOT, init)
        assert [*imports(init), *imports(init, top_level=False)] == []


def test_tests_share_helpers_through_helper_modules_and_conftest():
    """tests/ is a room too: its helper modules live in tests/helpers/ (tests/ holds test modules and conftest.py
    only), no test module imports another test module as a library (fixtures are in tests/conftest.py), and a helper
    module is imported one way, `from tests.helpers.launch import ...`, never as a bare top-level `launch` or
    `helpers.launch` (a second copy of the module)."""
    folder, helper_folder = os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "helpers")
    helpers = {n[:-3] for n in os.listdir(helper_folder) if n.endswith(".py") and n != "__init__.py"}
    problems = [f"tests/{n} is neither a test module nor conftest.py: move it to tests/helpers/"
                for n in sorted(os.listdir(folder)) if n.endswith(".py") and not n.startswith("test_")
                and n != "conftest.py"]
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".py")]
    paths += [os.path.join(helper_folder, n) for n in sorted(os.listdir(helper_folder)) if n.endswith(".py")]
    for path in paths:
        name = os.path.relpath(path, folder)
        for module in set(imports(path)) | set(imports(path, top_level=False)):
            parts = module.split(".")
            if parts[0] == "tests" and len(parts) > 1 and parts[1].startswith("test_"):
                problems.append(f"tests/{name} imports the test module {module}")
            if parts[0] in helpers or parts[0] == "helpers":
                problems.append(f"tests/{name} imports {module}: write tests.helpers.{parts[-1]}")
            if parts[0] == "tests" and len(parts) == 2 and parts[1] in helpers:
                problems.append(f"tests/{name} imports {module}: write tests.helpers.{parts[1]}")
    assert problems == []
    assert {"launch", "serving", "layouts", "fault_entry"} <= helpers  # the check saw the helper modules
