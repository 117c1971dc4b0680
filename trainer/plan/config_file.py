"""--config run.yaml: flags from a YAML file (the flags' own names), the command line overriding them; and the run's
flags written back as YAML beside its checkpoints, so `--config <that file>` repeats the run.

The file's entries become command-line tokens placed before the typed ones, so argparse checks them like typed
flags (types, choices, one usage error naming the flag) and a flag given on the command line wins.
"""
import argparse

import yaml

from model.atomic import atomic_write_text


def config_argv(parser, argv):
    """`argv` with the --config file's flags in front (argv itself when there is no --config)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --conf is not --config
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return argv
    try:
        with open(known.config) as f:
            entries = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        mark = getattr(e, "problem_mark", None)  # where the YAML parser stopped
        where = f"line {mark.line + 1}: {e.problem}" if mark is not None else str(e).splitlines()[0]
        parser.error(f"--config {known.config}: not a readable YAML file ({where})")
    if not isinstance(entries, dict):
        parser.error(f"--config {known.config}: expected `flag_name: value` lines, got a {type(entries).__name__}")
    actions = {action.dest: action for action in parser._actions}
    tokens = []
    for name, value in entries.items():
        action = actions.get(name)
        if action is None or name in ("help", "config"):
            parser.error(f"--config {known.config}: {name} is not a flag of this script")
        check_value(parser, known.config, name, action, value)
        tokens += flag_tokens(action, value)
    return tokens + list(argv)


def check_value(parser, path, name, action, value):
    """A usage error naming the file and the key when `value` does not convert to the flag's type or choices (as
    typed, argparse's line would name the flag only)."""
    if value is None or action.nargs == 0:
        return
    text = str(int(value) if isinstance(value, bool) else value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        kind = getattr(action.type, "__name__", "value")
        parser.error(f"--config {path}: {name}: {value!r} is not a valid {kind} ({e})")
    if action.choices is not None and converted not in action.choices:
        parser.error(f"--config {path}: {name}: {value!r} is not one of {', '.join(map(str, action.choices))}")


def flag_tokens(action, value):
    """The command-line tokens that set `action` to `value` (None: leave the default)."""
    flag = action.option_strings[0]
    if value is None:
        return []
    if action.nargs == 0:  # store_true (MiniMind's --use_wandb)
        return [flag] if value else []
    if isinstance(value, bool):  # the 0/1 switches written as true/false
        value = int(value)
    return [flag, str(value)]


def run_config_text(flags):
    """The run's flags as YAML (the order of --help), without --config itself: what `--config` reads back."""
    return yaml.safe_dump({k: v for k, v in flags.items() if k != "config"}, sort_keys=False)


def run_config_path(plan):
    """<checkpoint_dir>/<save_weight>_<hidden>[_moe]_config.yaml, beside the run's checkpoint folder."""
    return plan.io.run_dir + "_config.yaml"


def write_run_config(plan):
    """The flags of this run as typed (file values included) at run_config_path, atomically (rank 0 calls)."""
    path = run_config_path(plan)
    atomic_write_text(path, run_config_text(plan.flags))
    return path
