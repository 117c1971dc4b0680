"""trainer/base/schema.py: a flag declared once, a Flag in its section's FLAGS, gives the parser's argument and the
plan's field of its name; no flag of the trainer is declared any other way."""
import argparse
import ast
import os
from dataclasses import dataclass
from typing import Optional

import pytest

from tests.helpers.launch import ROOT
from trainer.base.schema import Flag, fill, section_flags
from trainer.plan.sections import SECTIONS


@dataclass(frozen=True)
class Section:
    """A section as trainer/plan/sections.py writes them."""
    steps: int
    switch: bool
    note: Optional[str]
    mode: str
    width: float  # derived by resolve
    FLAGS = (Flag("steps", int, 3, "a copied int"),
             Flag("switch", bool, 0, "a 0/1 switch, a bool in the plan"),
             Flag("note", str, None, "unset by default"),
             Flag("mode", str, "a", "a choice", choices=("a", "b")),
             Flag("size", int, 7, "read by resolve only"),
             Flag("loud", bool, False, "argparse's own", action="store_true"))


def parser():
    p = argparse.ArgumentParser()
    for declared in section_flags(Section):
        declared.add_to(p)
    return p


def test_a_declaration_is_the_argument_and_the_field():
    assert [f.name for f in section_flags(Section)] == ["steps", "switch", "note", "mode", "size", "loud"]
    args = parser().parse_args(["--steps", "5", "--switch", "1", "--mode", "b", "--size", "9", "--loud"])
    assert vars(args) == dict(steps=5, switch=1, note=None, mode="b", size=9, loud=True)
    section = fill(Section, args, width=args.size / 2)
    assert section == Section(steps=5, switch=True, note=None, mode="b", width=4.5)
    assert fill(Section, args, steps=1, width=0.0).steps == 1  # a derived value takes the flag's place
    defaults = parser().parse_args([])
    assert (defaults.steps, defaults.switch, defaults.note, defaults.mode, defaults.size) == (3, 0, None, "a", 7)


def test_bad_values_are_argparse_errors_and_a_forgotten_field_a_type_error():
    for argv in (["--switch", "2"], ["--mode", "c"], ["--steps", "x"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    with pytest.raises(TypeError, match="width"):
        fill(Section, parser().parse_args([]))


def test_every_flag_of_the_plan_is_declared_once():
    names = [f.name for section in SECTIONS for f in section_flags(section)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def flag_declarations(path):
    """(line, how) of every way `path` declares a command-line flag other than a Flag(...) inside an assignment to a
    name ending in FLAGS: a call named flag(), a dataclass field() with metadata, an argparse add_argument, a Flag(...)
    anywhere else."""
    tree = ast.parse(open(path).read())
    tuples = [assign.value for assign in ast.walk(tree) if isinstance(assign, ast.Assign)
              and any(getattr(t, "id", "").endswith("FLAGS") for t in assign.targets)]
    inside = {id(node) for value in tuples for node in ast.walk(value)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        with_metadata = name == "field" and any(k.arg == "metadata" for k in node.keywords)  # where a flag would hide
        if name in ("flag", "add_argument") or with_metadata or (name == "Flag" and id(node) not in inside):
            found.append((node.lineno, name))
    return found


# the two places that call argparse themselves: Flag's own argument, and the --config pre-parser, which reads the file
# name before the parser exists (--config itself is IOPlan's Flag)
ARGPARSE_CALLS = {("trainer/base/schema.py", "add_argument"), ("trainer/plan/config_file.py", "add_argument")}


def test_every_flag_is_a_flag_in_a_flags_tuple():
    """One declaration style in trainer/: Flag(name, type, default, help) in a FLAGS tuple (a section's, a stage plan's,
    or a shared one such as GROUP_FLAGS); no dataclass field carries a flag, no module adds an argument of its own."""
    found = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "trainer")):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/")
            found += [f"{path}:{line} {how}" for line, how in flag_declarations(os.path.join(ROOT, path))
                      if (path, how) not in ARGPARSE_CALLS]
    assert found == []


def test_the_style_check_sees_the_other_styles(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import dataclasses\nGROUP_FLAGS = (Flag('a', int, 1, 'h'),)\n\n\nclass P:\n"
                      "    x: int = flag(1, 'h')\n    y: int = dataclasses.field(metadata={})\n"
                      "    z: dict = dataclasses.field(default_factory=dict)\n"
                      "    FLAGS = GROUP_FLAGS + (Flag('b', int, 2, 'h'),)\n\n\n"
                      "def f(parser):\n    parser.add_argument('--c')\n    return Flag('d', int, 3, 'h')\n")
    assert flag_declarations(module) == [(6, "flag"), (7, "field"), (13, "add_argument"), (14, "Flag")]
