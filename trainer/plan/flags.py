"""The flag schema: the training scripts' parser, built from the flags the plan's sections declare
(trainer/plan/sections.py, trainer/base/schema.py) and the stage's own (Stage.FLAGS); nothing else.
--help lists them by section with their defaults.
"""
import argparse
import difflib
import sys
from dataclasses import fields

from trainer.base.schema import section_flags
from trainer.plan.config_file import config_argv
from trainer.plan.sections import SECTIONS, ModelPlan, TrainPlan
from trainer.plan.stage import Stage

MODEL_FLAGS = tuple(f.name for f in ModelPlan.SHAPE_FLAGS)  # the flags that are MiniMindConfig fields
PLAN_NAMES = {f.type: f.name for f in fields(TrainPlan)}  # section class -> its name in the plan


def declared_flags(stage=Stage):
    """Every Flag of the sections and of `stage` (a trainer/plan/stage.py Stage class), in --help's order."""
    return [declared for section in SECTIONS for declared in section_flags(section)] + list(stage.FLAGS)


def add_train_args(parser, stage=Stage, **defaults):
    """Every section's flags, one argument group each, then the stage's (a trainer/plan/stage.py Stage class);
    `defaults` sets the script-specific values."""
    for section in SECTIONS:
        group = parser.add_argument_group(f"plan.{PLAN_NAMES[section]}", section.__doc__.split("\n")[0])
        for declared in section_flags(section):
            declared.add_to(group)
    if stage.FLAGS:
        group = parser.add_argument_group(f"plan.stage ({stage.name})", stage.__doc__.split("\n")[0])
        for declared in stage.FLAGS:
            declared.add_to(group)
    parser.set_defaults(**defaults)
    return parser


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to a flag's help unless the help says its default itself (a None default means
    "unset", which the help explains: "(default: out/ in the repo)", not "... (default: None)")."""

    def _get_help_string(self, action):
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


class FlagParser(argparse.ArgumentParser):
    """No abbreviations (`--epoch 3` was taken as --epochs) and a bad flag in one line with the nearest real one, not
    the whole usage: "error: unknown flag --epcohs; did you mean --epochs?" (exit 2)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {self.unknown_flags(message) or message}; --help lists every flag\n")

    def unknown_flags(self, message):
        """'unknown flag --epcohs (did you mean --epochs?)' for the --flags argparse's message calls unrecognized;
        None when it names none (a stray value: argparse's words say it)."""
        if not message.startswith("unrecognized arguments:"):
            return None
        known = [option for action in self._actions for option in action.option_strings]
        unknown = [arg.split("=", 1)[0] for arg in message.split(":", 1)[1].split() if arg.startswith("--")]
        guesses = [difflib.get_close_matches(arg, known, n=1, cutoff=0.6) for arg in unknown]
        return "; ".join(f"unknown flag {arg}" + (f" (did you mean {guess[0]}?)" if guess else "")
                         for arg, guess in zip(unknown, guesses)) or None


def parse_args(description, stage=Stage, **defaults):
    """The script's flags (plus the stage's own, stage.FLAGS); --help shows every default."""
    parser = FlagParser(description=description, formatter_class=DefaultsOnce)
    add_train_args(parser, stage, **defaults)
    return parser.parse_args(config_argv(parser, sys.argv[1:]))
