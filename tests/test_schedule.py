"""trainer/runtime/schedule.py: each --lr_schedule against its formula written out here, MiniMind's default bit for
bit, the large-batch scaling rules, the length that follows --max_steps, and the lr column of a real run."""
import argparse
import math
import os

import pytest

from model.errors import ConfigError
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.runtime.schedule import lr_at, resume_note
from trainer.trainer_utils import get_lr


def plan_for(*argv, world_size=1):
    args = add_train_args(argparse.ArgumentParser()).parse_args([*TINY_MODEL, "--device", "cpu", *argv])
    return resolve(args, world_size)


@pytest.mark.parametrize("warmup", [0, 7])
def test_default_is_minimind_cosine_bit_for_bit(warmup):
    """MiniMind's trainer: lr * (0.1 + 0.45 * (1 + cos(pi * t / T))) after a linear warm-up, exactly (==)."""
    schedule = plan_for("--learning_rate", "5e-4", "--warmup_steps", str(warmup)).lr
    total = 97
    for step in range(total + 3):
        if step < warmup:
            want = 5e-4 * (step + 1) / warmup
        else:
            t, span = step - warmup, max(1, total - warmup)
            want = 5e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, span) / span)))
        assert lr_at(schedule, step, total) == want, step
        assert get_lr(step, total, 5e-4, warmup) == want  # MiniMind's helper name, the same function


def test_schedules_against_their_formulas():
    lr, floor, total, warmup = 1e-3, 1e-4, 50, 5
    common = ["--learning_rate", str(lr), "--min_lr", str(floor), "--warmup_steps", str(warmup)]
    linear = plan_for(*common, "--lr_schedule", "linear").lr
    wsd = plan_for(*common, "--lr_schedule", "wsd", "--wsd_decay_fraction", "0.2").lr
    constant = plan_for(*common, "--lr_schedule", "constant").lr
    cosine = plan_for(*common).lr
    for step in range(warmup):  # every schedule warms up the same way
        for schedule in (linear, wsd, constant, cosine):
            assert lr_at(schedule, step, total) == pytest.approx(lr * (step + 1) / warmup, rel=1e-12)
    for step in range(warmup, total + 2):
        p = min(step - warmup, total - warmup) / (total - warmup)
        assert lr_at(linear, step, total) == pytest.approx(floor + (lr - floor) * (1 - p), rel=1e-12)
        assert lr_at(cosine, step, total) == pytest.approx(floor + (lr - floor) / 2 * (1 + math.cos(math.pi * p)),
                                                           rel=1e-12)
        assert lr_at(constant, step, total) == lr
        decay_start = (total - warmup) - 9  # 20% of the 45 post-warm-up steps, rounded
        q = min(max(0, step - warmup - decay_start), 9) / 9
        assert lr_at(wsd, step, total) == pytest.approx(floor + (lr - floor) * (1 - q), rel=1e-12), step
    assert lr_at(wsd, warmup + 35, total) == lr and lr_at(wsd, total, total) == pytest.approx(floor, rel=1e-12)


def test_scaling_with_the_global_batch_and_the_length():
    # global batch 4 x 2 x dp 4 = 32 samples against a base of 8: x4 (linear), x2 (sqrt)
    common = ["--learning_rate", "1e-3", "--batch_size", "4", "--accumulation_steps", "2", "--base_batch", "8"]
    assert plan_for(*common, "--lr_scaling", "linear", world_size=4).lr.peak == pytest.approx(4e-3, rel=1e-15)
    assert plan_for(*common, "--lr_scaling", "sqrt", world_size=4).lr.peak == pytest.approx(2e-3, rel=1e-15)
    assert plan_for(*common, world_size=4).lr.peak == 1e-3  # --lr_scaling none (the default)
    assert "x sqrt(32/8)" in plan_for(*common, "--lr_scaling", "sqrt", world_size=4).lr.describe(10)
    with pytest.raises(ConfigError, match="give --base_batch"):
        plan_for("--lr_scaling", "linear")
    with pytest.raises(ConfigError, match="--min_lr must be between 0 and the peak"):
        plan_for("--learning_rate", "1e-3", "--min_lr", "2e-3")
    schedule = plan_for("--max_steps", "40").lr
    assert schedule.length(steps_per_epoch=100, epochs=2) == 40  # --max_steps ends the schedule too
    assert plan_for().lr.length(steps_per_epoch=100, epochs=2) == 200  # every epoch
    assert schedule.length(steps_per_epoch=10, epochs=2) == 20  # the epochs end first
    assert resume_note({"max_steps": 20, "epochs": 1}, schedule, 40, 100).startswith("the lr schedule now spans 40")
    assert resume_note({"max_steps": 40, "epochs": 1}, schedule, 40, 100) is None


def test_a_run_logs_the_scheduled_lr_and_says_it_at_start(tmp_path):
    """A real run with --lr_schedule linear, warm-up, --min_lr and --max_steps: the metrics' lr column is the linear
    formula over the 6 steps --max_steps gives the schedule (not the epoch's)."""
    data = demo_slice(tmp_path, "pretrain", 64)
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "1",
        "--max_steps", "6", "--learning_rate", "2e-3", "--min_lr", "2e-4", "--warmup_steps", "2",
        "--lr_schedule", "linear", "--log_interval", "1", "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--metrics_file", str(tmp_path / "m.jsonl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lr 2.000e-03: 2 warm-up steps, then linear to 2.000e-04, 6 steps" in proc.stdout
    lrs = [r["lr"] for r in read_metrics(os.path.join(tmp_path, "m.jsonl"))]
    # steps 1-2 warm up; steps 3-6 are t = 0..3 of the 4 left (the floor would be step 7's, as in MiniMind's cosine)
    want = [2e-3 * 1 / 2, 2e-3] + [2e-4 + (2e-3 - 2e-4) * (1 - t / 4) for t in (0, 1, 2, 3)]
    assert lrs == pytest.approx(want, rel=1e-12)
