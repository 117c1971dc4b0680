"""How a flag is declared: once, with the plan section it belongs to, so the parser (trainer/plan/flags.py) and the plan
(trainer/plan/resolve.py resolve) both derive from the one declaration.

  - a section field `name: type = flag(default, help)`: the plan holds the flag's value under its name, as typed (a
    0/1 switch as a bool) unless resolve derives it (a path made absolute, the zero stage actually used);
  - a `Flag(name, type, default, help)` in the section's FLAGS: resolve reads it to derive something else (--batch_size
    -> micro_batch, the model's sizes -> its MiniMindConfig).
"""
import dataclasses
import typing
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


def flag(default, help, type=None, choices=None, action=None, min=None, hint=None):
    """A section field that is also the flag --<field name>; type: the flag's when the field's annotation is not it
    (a field of the resolved value, e.g. a torch.dtype from a name); min, hint: as Flag's."""
    return dataclasses.field(metadata={"flag": dict(default=default, help=help, type=type, choices=choices,
                                                    action=action, min=min, hint=hint)})


def field_flag(field):
    """The Flag a section field declares, or None."""
    spec = field.metadata.get("flag")
    if spec is None:
        return None
    kind = spec["type"] or field.type
    if typing.get_origin(kind) is typing.Union:  # Optional[X]: X, the flag's default None meaning "unset"
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return Flag(field.name, kind, spec["default"], spec["help"], spec["choices"], spec["action"], spec["min"],
                spec["hint"])


def section_flags(section):
    """Every flag a section (a dataclass) declares: its flag fields, then its FLAGS."""
    fields = [field_flag(f) for f in dataclasses.fields(section)]
    return [f for f in fields if f is not None] + list(section.FLAGS)


def fill(section, args, **derived):
    """The section from the flags as typed (0/1 switches as bools) and the values resolve derived, which take the
    place of a flag's own; a field that is neither is a TypeError (a value resolve forgot)."""
    values = {}
    for field in dataclasses.fields(section):
        declared = field_flag(field)
        if field.name not in derived and declared is not None:
            value = getattr(args, field.name)
            values[field.name] = bool(value) if declared.type is bool else value
    return section(**values, **derived)
