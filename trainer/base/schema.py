"""How a flag is declared: once, as a `Flag(name, type, default, help)` in the FLAGS of the plan section (or stage plan)
it belongs to, so the parser (trainer/plan/flags.py) and the plan (trainer/plan/resolve.py resolve) both derive from the
one declaration. A section field named like one of its flags holds that flag's value as typed (a 0/1 switch as a bool)
unless resolve derives it (a path made absolute, the zero stage actually used); a flag no field is named after is read
by resolve to derive something else (--batch_size -> micro_batch, the model's sizes -> its MiniMindConfig). A field
named like no flag is one resolve derives. tests/test_schema.py checks that no flag is declared another way.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Flag:
    """--name: its type (int, float, str; bool: a 0/1 switch), default, help and choices; action: argparse's own
    (store_true) instead of a typed value; min: the smallest value it takes (None, the "unset" default, always passes),
    hint: what to know about that range, said when a value is below it."""
    name: str
    type: type
    default: object
    help: str
    choices: Optional[tuple] = None
    action: Optional[str] = None
    min: Optional[int] = None
    hint: Optional[str] = None

    def add_to(self, parser):
        """The argparse argument."""
        if self.action:
            return parser.add_argument(f"--{self.name}", action=self.action, help=self.help)
        kind, choices = (int, (0, 1)) if self.type is bool else (self.type, self.choices)
        return parser.add_argument(f"--{self.name}", type=None if kind is str else kind, default=self.default,
                                   choices=list(choices) if choices else None, help=self.help)


def section_flags(section):
    """Every flag a section (a dataclass) declares: its FLAGS."""
    return list(section.FLAGS)


def fill(section, args, **derived):
    """The section from its flags as typed (each field named like one of its FLAGS; 0/1 switches as bools) and the
    values resolve derived, which take the place of a flag's own; a field that is neither is a TypeError (a value
    resolve forgot)."""
    declared = {flag.name: flag for flag in section.FLAGS}
    values = {}
    for field in dataclasses.fields(section):
        if field.name not in derived and field.name in declared:
            value = getattr(args, field.name)
            values[field.name] = bool(value) if declared[field.name].type is bool else value
    return section(**values, **derived)
