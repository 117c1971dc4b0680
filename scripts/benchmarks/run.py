"""Run the real trainer in a temporary folder and return its metrics records (for bench and quality); the benchmark's
default model and the trainer flags a bench command line passes through."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

from model.weights.paths import ROOT
from trainer.plan.flags import add_train_args

TRAIN_SCRIPT = os.path.join(ROOT, "trainer", "train_pretrain.py")
# the benchmark's default model: MiniMind's small config
BENCH_DEFAULTS = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_seq_len=256, batch_size=8, accumulation_steps=1,
                      device="cuda:0" if torch.cuda.is_available() else "cpu")


def trainer_command(flags, nproc, script=TRAIN_SCRIPT):
    """argv for one run of `script` with `flags` (a dict of trainer flag -> value); torchrun when nproc > 1."""
    argv = []
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]  # True: store_true flags
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return launcher + [script] + argv


def trainer_args(flags):
    """The trainer's argument namespace for `flags` (a dict of trainer flags; --baseline_flags gives strings), parsed
    as the trainer parses its command line, its defaults for the rest."""
    return add_train_args(argparse.ArgumentParser()).parse_args(trainer_command(flags, nproc=1)[2:])


def run_argv(argv, log_path):
    """Run argv from the repo root, its output appended to log_path; the exit code."""
    with open(log_path, "a") as log:
        return subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def run_trainer(flags, log_path, nproc=1, work=None, script=TRAIN_SCRIPT):
    """Run the trainer with `flags`, its outputs under `work` (default: a temp folder removed after).

    Metrics, weights and checkpoints go to work/metrics.jsonl, work/out, work/ckpt unless `flags` names them;
    the trainer's output goes to `log_path`. Returns the metrics records; a failed run raises RuntimeError.
    """
    tmp = None if work else tempfile.mkdtemp(prefix="run_")
    work = work or tmp
    try:
        flags = dict(dict(metrics_file=os.path.join(work, "metrics.jsonl"), save_dir=os.path.join(work, "out"),
                          checkpoint_dir=os.path.join(work, "ckpt")), **flags)
        argv = trainer_command(flags, nproc, script)
        with open(log_path, "w") as log:
            log.write(" ".join(argv) + "\n")
        code = run_argv(argv, log_path)
        if code != 0:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"trainer exited with {code}; log {log_path}:\n{tail}")
        with open(flags["metrics_file"]) as f:
            return [json.loads(line) for line in f if line.strip()]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def given_trainer_flags(parser, rest):
    """The trainer flags among `rest` (only those given, as a dict); anything else is a usage error."""
    trainer = add_train_args(argparse.ArgumentParser(allow_abbrev=False))
    for action in trainer._actions:
        action.default = argparse.SUPPRESS  # keep only the trainer flags given on the command line
    given, unknown = trainer.parse_known_args(rest)
    if unknown:
        parser.error(f"unknown flags (neither {parser.prog} nor trainer): {' '.join(unknown)}")
    return vars(given)


def step_stats(records, warmup):
    """Figures over the step records after `warmup` steps (trainer metrics with --log_interval 1).

    A step's time is its target tokens / its tokens_per_sec (the trainer's own window for that step).
    """
    steps = sorted((r for r in records if "tokens_per_sec" in r), key=lambda r: r["step"])
    prev_tokens = {s["step"]: p["tokens"] for p, s in zip(steps, steps[1:])}
    measured = [r for r in steps if r["step"] > warmup and r["step"] in prev_tokens]
    if not measured:
        raise ValueError(f"no step records after {warmup} warm-up steps")
    tokens = [r["tokens"] - prev_tokens[r["step"]] for r in measured]
    times = [t / r["tokens_per_sec"] for t, r in zip(tokens, measured)]
    total_time = sum(times)
    return dict(
        steps=len(measured), tokens_per_sec=sum(tokens) / total_time,
        step_time_median=statistics.median(times), step_time_min=min(times), step_time_max=max(times),
        step_time_stdev=statistics.stdev(times) if len(times) > 1 else 0.0,
        mfu=sum(r["mfu"] * t for r, t in zip(measured, times)) / total_time,  # time-weighted, as the trainer defines it
        peak_mem_gb=max(r["peak_mem_gb"] for r in steps),
        final_step=steps[-1]["step"], final_loss=steps[-1]["loss"],
        final_loss_mean10=statistics.mean(r["loss"] for r in steps[-10:]),  # one step's batch is noisy
        tokens_per_step=sum(tokens) / len(tokens),
        tokens_per_sec_median=statistics.median(tokens) / statistics.median(times))  # robust to load spikes
