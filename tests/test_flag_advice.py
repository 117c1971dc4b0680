"""Advice names flags that exist: every `--flag` in a message of trainer/, scripts/, model/ and dataset/ (any string
literal in code, refusals and their advice included; docstrings and comments aside) is a flag some script of this
repository declares, or one of the few named below that belong to other programs."""
import argparse
import ast
import os
import re

from model.export.gguf import gguf_refusal
from model.model_minimind import MiniMindConfig
from tests.helpers.launch import ROOT
from trainer.plan.flags import add_train_args

SOURCES = ("trainer", "scripts", "model", "dataset")
FLAG = re.compile(r"(?<![\w.-])--([a-z][a-z0-9_]*(?:-[a-z0-9_]+)*)")
OTHER_PROGRAMS = {"nproc_per_node": "torchrun", "standalone": "torchrun", "max-restarts": "torchrun",
                  "junitxml": "pytest", "browser": "streamlit (--browser.gatherUsageStats)",
                  "server": "streamlit (--server.address)"}


def python_files(folders):
    for folder in folders:
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))


def message_strings(tree):
    """(text, line) of every string literal outside docstrings; an f-string's values read as NUL."""
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        if isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values), node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value, node.lineno


def declared_flags():
    """Every flag a parser here declares: the trainers' (their sections' fields and Flag declarations, by the
    trainers' own parser builder and by Flag("name") in source, which stage FLAGS use) and each script's
    add_argument("--name", "--alias") (a "--name" literal passed to any call, or looked for in argv)."""
    parser = add_train_args(argparse.ArgumentParser())
    flags = {opt[2:] for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    for path in python_files(SOURCES):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):  # `"--write" in argv`
                flags.update(re.findall(r"^--([a-z0-9_-]+)$", str(node.left.value)))
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if re.fullmatch(r"--[a-z0-9_-]+", arg.value):
                        flags.add(arg.value[2:])
                    elif name == "Flag" and arg is node.args[0]:
                        flags.add(arg.value)
    return flags


def test_every_suggested_flag_exists():
    declared = declared_flags()
    assert {"hidden_size", "from_resume", "ep", "to", "format", "lora_weight"} <= declared  # the collector sees them
    unknown = []
    for path in python_files(SOURCES):
        for text, line in message_strings(ast.parse(open(path).read())):
            unknown += [f"{os.path.relpath(path, ROOT)}:{line}: --{flag}" for flag in FLAG.findall(text)
                        if flag not in declared and flag not in OTHER_PROGRAMS]
    assert unknown == []


def test_the_gguf_refusal_for_shared_experts_names_no_missing_flag():
    line = gguf_refusal(MiniMindConfig(use_moe=True, n_shared_experts=1))
    assert line.startswith("n_shared_experts=1: llama.cpp's qwen3moe has no shared experts")
    assert "--n_shared" not in line
