"""Runs that die and come back: torchrun restarts and SIGKILLs at random points resume to the uninterrupted losses.

A killed run leaves at most a save without its manifest; `--from_resume auto` takes the newest complete one, and
the metrics file is cut back to it, so every step is logged once and equals the uninterrupted run's.
"""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, free_port, read_metrics, start_forked

SCRIPT = os.path.join(ROOT, "trainer", "train_pretrain.py")
FAULT_SCRIPT = os.path.join(ROOT, "tests", "helpers", "fault_entry.py")  # the same script, faults injected by the test


def run_args(workdir, data, *extra):
    return [*TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "64", "--accumulation_steps", "2",
            "--learning_rate", "2e-3", "--log_interval", "1", "--from_resume", "auto", "--keep_checkpoints", "2",
            "--save_dir", os.path.join(workdir, "out"), "--checkpoint_dir", os.path.join(workdir, "ckpt"),
            "--metrics_file", os.path.join(workdir, "m.jsonl"), *extra]


def assert_same_losses(records, reference):
    """One record per step, each loss exactly the uninterrupted run's (same layout, same state restored)."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    def values(rs):
        return [(r["loss"], r["tokens"], r["lr"]) for r in rs]
    assert values(records) == values(reference)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_slice(tmp_path_factory.mktemp("data"), "pretrain", 48)


def test_torchrun_restart_resumes_exactly(data, tmp_path):
    """torchrun --max-restarts 1, rank 1 SIGKILLed after step 3: the restart resumes from step 2's checkpoint."""
    two_rank = ["--batch_size", "2", "--epochs", "1", "--save_interval", "2", "--dist_timeout", "60"]  # 6 steps
    reference = forked(SCRIPT, run_args(str(tmp_path / "ref"), data, *two_rank), 2, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", FAULT_SCRIPT,
           *run_args(str(tmp_path / "run"), data, *two_rank)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MINIMIND_TEST_KILL_AT_STEP="3", MINIMIND_TEST_KILL_RANK="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "exitcode: -9" in proc.stderr  # the kill really happened, and the agent restarted the workers
    assert f"Resuming from {tmp_path / 'run' / 'ckpt' / 'pretrain_64' / 'step_2'}" in proc.stdout
    assert_same_losses(read_metrics(str(tmp_path / "run" / "m.jsonl")), read_metrics(str(tmp_path / "ref" / "m.jsonl")))


def complete_lines(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return f.read().count("\n")


def kill_at_random(args, metrics, rng):
    """Start the run, wait for one more logged step, SIGKILL it a random fraction of a step later."""
    before = complete_lines(metrics)
    proc = start_forked(SCRIPT, args)
    try:
        deadline = time.time() + 120
        while complete_lines(metrics) <= before and proc.poll() is None:
            assert time.time() < deadline, "the run logged no step"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))  # a step with its save takes ~0.1-0.5 s here: lands mid-step or mid-save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.parametrize("async_save", ["0", "1"])
def test_sigkill_mid_step_and_mid_save_resumes_exactly(async_save, data, tmp_path):
    """Killed inside a save (shards written, no manifest) and at random points: every resume continues exactly."""
    single = ["--batch_size", "4", "--epochs", "2", "--save_interval", "1", "--async_save", async_save]  # 12 steps
    reference = forked(SCRIPT, run_args(str(tmp_path / "ref"), data, *single), timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    args, metrics = run_args(str(tmp_path / "run"), data, *single), str(tmp_path / "run" / "m.jsonl")
    killed = forked(FAULT_SCRIPT, args, timeout=300,
                    env=dict(MINIMIND_TEST_KILL_AT_STEP="3", MINIMIND_TEST_KILL_POINT="save"))
    assert killed.returncode == -signal.SIGKILL
    step_3 = tmp_path / "run" / "ckpt" / "pretrain_64" / "step_3"
    assert step_3.is_dir() and not (step_3 / "complete.json").exists()
    rng = random.Random(int(async_save))
    for _ in range(2):
        kill_at_random(args, metrics, rng)
    finished = forked(SCRIPT, args, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Resuming from" in finished.stdout
    assert_same_losses(read_metrics(metrics), read_metrics(str(tmp_path / "ref" / "m.jsonl")))
    kept = sorted(os.listdir(tmp_path / "run" / "ckpt" / "pretrain_64"))
    assert kept == ["step_11", "step_12"]  # --keep_checkpoints 2; partial saves are gone
