"""trainer/base/schema.py: a flag declared once, in its section, gives the parser's argument and the plan's field."""
import argparse
from dataclasses import dataclass
from typing import Optional

import pytest

from trainer.base.schema import Flag, fill, flag, section_flags
from trainer.plan.sections import SECTIONS


@dataclass(frozen=True)
class Section:
    """A section as trainer/plan/sections.py writes them."""
    steps: int = flag(3, "a copied int")
    switch: bool = flag(0, "a 0/1 switch, a bool in the plan")
    note: Optional[str] = flag(None, "unset by default")
    mode: str = flag("a", "a choice", choices=("a", "b"))
    width: float  # derived by resolve
    FLAGS = (Flag("size", int, 7, "read by resolve only"),
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
