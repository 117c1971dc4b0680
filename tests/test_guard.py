"""trainer/runtime/step_guard.py: non-finite steps are skipped on every rank and counted; diverged replicas are
named."""
import argparse
import os

import torch

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.core.build import build_trainer, setup
from trainer.plan.flags import add_train_args

SCRIPT = "trainer/train_pretrain.py"
FAULT_SCRIPT = "tests/helpers/fault_entry.py"  # the same script, with faults injected from the test side


def common_args(tmp_path, name, data):
    out = os.path.join(str(tmp_path), name)
    return [*TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "32", "--batch_size", "2",
            "--accumulation_steps", "2", "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt"),
            "--metrics_file", os.path.join(out, "metrics.jsonl"), "--log_interval", "1", "--save_interval", "1"]


def restored(argv):
    """Model and optimizer state of the newest checkpoint of a run, loaded by the trainer itself (any format)."""
    args = add_train_args(argparse.ArgumentParser()).parse_args([*argv, "--from_resume", "1", "--device", "cpu"])
    plan, dims = setup(args)
    trainer = build_trainer(plan, dims, steps_per_epoch=1)
    return trainer.progress.global_step, trainer.model_parts[0].state_dict(), trainer.optimizer.state_dict()


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 60)
    # lr 1e30: step 1 throws the weights to ~1e30, so every later gradient norm is NaN
    bad = [*common_args(tmp_path, "bad", data), "--learning_rate", "1e30", "--max_bad_steps", "3", "--max_steps", "10"]
    proc = forked(SCRIPT, bad, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 optimizer steps in a row (to step 4)") and "last good checkpoint is step 1" in last
    for step in (2, 3, 4):
        assert f"step {step}: non-finite" in proc.stdout
    records = read_metrics(os.path.join(str(tmp_path), "bad", "metrics.jsonl"))
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 1), (3, 2)]
    # reference: the same run stopped after its one good step
    ref = [*common_args(tmp_path, "ref", data), "--learning_rate", "1e30", "--max_steps", "1"]
    assert forked(SCRIPT, ref, timeout=300).returncode == 0
    step, model, optim = restored(bad)
    ref_step, ref_model, ref_optim = restored(ref)
    assert (step, ref_step) == (3, 1)  # saved after two skipped steps
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)  # the skipped steps left weights ...
    for key, state in ref_optim["state"].items():  # ... and AdamW's moments and step count untouched
        assert all(torch.equal(optim["state"][key][k], v) for k, v in state.items()), key


def test_check_replicas_names_the_diverged_tensor(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 60)
    argv = [*common_args(tmp_path, "dp2", data), "--max_steps", "6", "--check_replicas", "1"]
    name = "model.layers.1.mlp.down_proj.weight"
    proc = forked(FAULT_SCRIPT, argv, 2, timeout=300, env={"MINIMIND_TEST_CORRUPT_REPLICA": f"1:3:{name}"})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: --check_replicas: at step 3 parameter {name} differs between data-parallel replicas "
                     "(group ranks [1] vs 0); the replicas diverged, resume from the last checkpoint and look for "
                     "non-deterministic or rank-dependent code"], proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(os.path.join(str(tmp_path), "dp2", "metrics.jsonl"))] == [1, 2, 3]


def test_time_based_saves_are_agreed_and_keep_the_gaps_under_the_limit(tmp_path):
    """--save_every_minutes 0.01 (0.6 s) with --save_interval far away, 2 ranks: checkpoints come at steps every rank
    chose together (a save is a collective: a disagreement would hang, not pass), and no two consecutive saves (the
    run's start and its last step counting as saves) lie further apart than the limit plus two steps."""
    data = demo_slice(tmp_path, "pretrain", 400)
    limit = 0.01 * 60
    argv = [*common_args(tmp_path, "timed", data), "--accumulation_steps", "4", "--save_interval", "1000",
            "--save_every_minutes", "0.01", "--keep_checkpoints", "0", "--max_steps", "24"]
    proc = forked(SCRIPT, argv, 2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(os.path.join(str(tmp_path), "timed", "metrics.jsonl"))
    run_dir = os.path.join(str(tmp_path), "timed", "ckpt", "pretrain_64")
    saved = sorted(int(name.split("_")[1]) for name in os.listdir(run_dir))
    assert saved[-1] == 24, saved
    finished = {r["step"]: r["elapsed_s"] for r in records}
    step_seconds = max(finished[s] - finished[s - 1] for s in range(2, 25))
    times = [0.0] + [finished[s] for s in saved]
    assert all(b - a <= limit + 2 * step_seconds for a, b in zip(times, times[1:])), (saved, times, step_seconds)
