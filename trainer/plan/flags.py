"""The flag schema: the training scripts' parser, built from the flags the plan's sections declare
(trainer/plan/sections.py, trainer/plan/schema.py) and the stage's own (Stage.FLAGS); nothing else.
--help lists them by section with their defaults.
"""
import argparse
import sys
from dataclasses import fields

from trainer.core.stage import Stage
from trainer.plan.config_file import config_argv
from trainer.plan.schema import section_flags
from trainer.plan.sections import SECTIONS, ModelPlan, TrainPlan

MODEL_FLAGS = tuple(f.name for f in ModelPlan.SHAPE_FLAGS)  # the flags that are MiniMindConfig fields
PLAN_NAMES = {f.type: f.name for f in fields(TrainPlan)}  # section class -> its name in the plan


def add_train_args(parser, stage=Stage, **defaults):
    """Every section's flags, one argument group each, then the stage's (a trainer/core/stage.py Stage class);
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


def parse_args(description, stage=Stage, **defaults):
    """The script's flags (plus the stage's own, stage.FLAGS); --help shows every default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=DefaultsOnce)
    add_train_args(parser, stage, **defaults)
    return parser.parse_args(config_argv(parser, sys.argv[1:]))
