"""trainer/ckpt/run_lock.py and step_dirs.py: one run per checkpoint directory, nothing finished destroyed, a step
complete only when every rank's files are there, and every rank resuming from the same step."""
import hashlib
import json
import os
import shutil
import signal
import socket
import time

import pytest

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, forked_nodes, read_metrics, start_forked

SCRIPT = "trainer/train_pretrain.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_slice(tmp_path_factory.mktemp("data"), "pretrain", 48)


def run_args(data, where, *extra):
    return [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
            "--log_interval", "1", "--save_dir", os.path.join(where, "out"), "--checkpoint_dir",
            os.path.join(where, "ckpt"), "--metrics_file", os.path.join(where, "m.jsonl"), *extra]


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def losses(path):
    return [(r["step"], r["loss"], r["tokens"]) for r in read_metrics(path)]


def test_a_rerun_is_refused_and_overwrite_starts_over(data, tmp_path):
    """A finished run's rerun without --from_resume stops before training, in one line naming what exists and the two
    ways on, and changes nothing; --overwrite 1 starts over: the same losses as the first (fresh) run, its
    checkpoints replaced."""
    where = str(tmp_path)
    args = run_args(data, where, "--max_steps", "3", "--save_interval", "1")
    first = forked(SCRIPT, args)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir, weights = os.path.join(where, "ckpt", "pretrain_64"), os.path.join(where, "out", "pretrain_64.pth")
    fresh = losses(os.path.join(where, "m.jsonl"))
    before = (sha(weights), sha(os.path.join(where, "m.jsonl")), sorted(os.listdir(run_dir)))
    manifest_time = os.path.getmtime(os.path.join(run_dir, "step_3", "complete.json"))
    again = forked(SCRIPT, args)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"error: run pretrain_64 exists: checkpoints of steps 1..3 in {run_dir} and weights {weights}; pass "
        "--from_resume 1 to continue it, or --overwrite 1 to start over (they are replaced), or choose another "
        "--save_weight or --checkpoint_dir")
    assert "| loss " not in again.stdout and "Model params" not in again.stdout  # before the model was built
    assert (sha(weights), sha(os.path.join(where, "m.jsonl")), sorted(os.listdir(run_dir))) == before
    over = forked(SCRIPT, [*args, "--overwrite", "1"])
    assert over.returncode == 0, over.stderr[-3000:]
    assert f"--overwrite 1: removed the earlier run's 3 checkpoint(s) in {run_dir}; starting over" in over.stdout
    assert [step for step, _, _ in fresh] == [1, 2, 3] and losses(os.path.join(where, "m.jsonl")) == fresh
    assert os.path.getmtime(os.path.join(run_dir, "step_3", "complete.json")) > manifest_time
    assert not os.path.exists(os.path.join(run_dir, "run.lock"))  # released at the end


def wait_for(condition, proc, what):
    """Poll until `condition()` holds while `proc` runs (a bound on the wait, not a timing check)."""
    deadline = time.time() + 120
    while not condition():
        assert proc.poll() is None, f"the first run ended before {what}"
        assert time.time() < deadline, f"no {what}"
        time.sleep(0.05)


def test_a_second_run_on_a_directory_is_refused_and_a_dead_runs_lock_taken_over(data, tmp_path):
    """While a run trains, another on its checkpoint directory stops in one line naming the first's host and pid
    (two such runs used to race on DCP's files); once the first is SIGKILLed its lock is stale and the next run on
    this host takes it over with a note, then finishes and releases it."""
    where = str(tmp_path)
    run_dir = os.path.join(where, "ckpt", "pretrain_64")
    lock = os.path.join(run_dir, "run.lock")
    long_run = run_args(data, where, "--from_resume", "auto", "--epochs", "1000", "--save_interval", "1000")
    first = start_forked(SCRIPT, long_run, log_path=os.path.join(where, "first.log"))
    try:
        wait_for(lambda: os.path.isfile(os.path.join(where, "m.jsonl")), first, "step logged")
        with open(lock) as f:
            holder = json.load(f)
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), first.pid)
        second = forked(SCRIPT, run_args(data, where, "--from_resume", "auto", "--max_steps", "2"))
        assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == (
            f"error: {run_dir} is in use by another run (host {socket.gethostname()}, pid {first.pid}, started "
            f"{holder['started']}); wait for it to end or choose another --save_weight or --checkpoint_dir (if that "
            f"run is gone, delete {lock})")
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert os.path.isfile(lock)  # a killed run leaves its lock
    third = forked(SCRIPT, run_args(data, where, "--overwrite", "1", "--max_steps", "2"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert (f"note: taking over {lock} of run pid {first.pid} on {socket.gethostname()}, which is no longer running"
            in third.stdout)
    assert [r["step"] for r in read_metrics(os.path.join(where, "m.jsonl"))] == [1, 2] and not os.path.exists(lock)


def node_args(data, where, *extra):
    return run_args(data, where, "--save_interval", "1", "--keep_checkpoints", "0", "--dist_timeout", "60", *extra)


def test_nodes_without_a_shared_checkpoint_directory(data, tmp_path):
    """Two ranks ('nodes'), each with a --checkpoint_dir of its own. A save is never marked complete: rank 0 lacks rank
    1's files, and every rank stops in one line naming the directory. --from_resume 1 takes the newest step both
    have (node 1 lost step 2: step 1), whose step 2 repeats the shared run's loss exactly; with none in common every
    rank's console says so in one line."""
    fresh = [node_args(data, str(tmp_path / f"node{n}"), "--max_steps", "2") for n in (0, 1)]
    code, outs, errs = forked_nodes(SCRIPT, fresh)
    step_1 = tmp_path / "node0" / "ckpt" / "pretrain_64" / "step_1"
    assert code == 2 and errs[0].strip().splitlines()[-1] == (
        f"error: {step_1} lacks files other ranks wrote (rng_1.pt, __1_0.distcp): its checkpoint cannot be marked "
        "complete; every node must see one --checkpoint_dir (a shared filesystem), or train on one node"), errs
    assert not any((tmp_path / f"node{n}" / "ckpt" / "pretrain_64" / "step_1" / "complete.json").exists()
                   for n in (0, 1))

    shared = str(tmp_path / "shared")
    proc = forked(SCRIPT, node_args(data, shared, "--max_steps", "2"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in (0, 1):
        shutil.rmtree(tmp_path / f"node{n}")
        shutil.copytree(shared, tmp_path / f"node{n}")
    shutil.rmtree(tmp_path / "node1" / "ckpt" / "pretrain_64" / "step_2")
    resumed = [node_args(data, str(tmp_path / f"node{n}"), "--max_steps", "2", "--from_resume", "1") for n in (0, 1)]
    code, outs, errs = forked_nodes(SCRIPT, resumed)
    node0_run = tmp_path / "node0" / "ckpt" / "pretrain_64"
    assert f"Resuming from {node0_run / 'step_1'}" in outs[0], outs[0][-2000:]
    assert "note: not every rank has step 2; resuming from step 1, the newest all have" in outs[0]
    assert losses(str(tmp_path / "node0" / "m.jsonl")) == losses(os.path.join(shared, "m.jsonl"))
    assert code == 2 and errs[0].strip().splitlines()[-1].startswith(f"error: {node0_run / 'step_2'} lacks files")

    shutil.rmtree(tmp_path / "node1" / "ckpt" / "pretrain_64")
    code, outs, errs = forked_nodes(SCRIPT, resumed)
    assert code == 2
    for n in (0, 1):  # each rank's own view, on each console
        run_dir = tmp_path / f"node{n}" / "ckpt" / "pretrain_64"
        assert errs[n].strip().splitlines()[-1] == (
            f"error: the ranks hold no complete checkpoint in common in {run_dir} (steps rank 0: 1; rank 1: none): "
            "every node must see one --checkpoint_dir (a shared filesystem); or --from_resume 0 --overwrite 1"), errs[n]
