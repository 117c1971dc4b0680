"""Runs stopped by a signal: start a trainer, wait for a step, signal a rank, finish."""
import os
import subprocess
import sys
import time

from tests.helpers.launch import ROOT, TINY_MODEL, free_port, read_metrics, start_forked
from trainer.observe import console

SCRIPT = "trainer/train_pretrain.py"


def run_args(tmp_path, name, data, max_steps):
    out = os.path.join(str(tmp_path), name)
    # 100 steps per epoch, far more than the few the signal lets through; a save only when stopped or at the end;
    # a constant lr: the stopped run and the uninterrupted one have different --max_steps (the schedule's length)
    return [*TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "32", "--batch_size", "2",
            "--accumulation_steps", "1", "--learning_rate", "2e-3", "--lr_schedule", "constant", "--save_dir", out,
            "--checkpoint_dir",
            os.path.join(out, "ckpt"), "--metrics_file", os.path.join(out, "metrics.jsonl"), "--log_interval", "1",
            "--save_interval", "1000", "--max_steps", str(max_steps)]


def metrics_path(argv):
    return argv[argv.index("--metrics_file") + 1]


def start(argv, nproc):
    """The run as a child process of this test (forked from it; torchrun for nproc > 1), output to a file."""
    os.makedirs(os.path.dirname(metrics_path(argv)), exist_ok=True)
    log = open(metrics_path(argv) + ".log", "w+")
    if nproc == 1:
        return start_forked(SCRIPT, argv, log.name), log
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), os.path.join(ROOT, SCRIPT), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env), log


def wait_for_step(proc, argv, step, timeout=240):
    """Block until the metrics file shows `step` (the run is mid-epoch, past its set-up)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics_path(argv)) and any(r["step"] >= step for r in read_metrics(metrics_path(argv))):
            return
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


def finish(proc, log, timeout=240):
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    with log:
        log.seek(0)
        return proc.returncode, log.read()


def rank_pid(proc, rank):
    """The pid of torchrun's worker with RANK=rank (Linux /proc: its children and their environments)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no worker with RANK={rank}")


def signal_at_micro_batch(monkeypatch, count, sig):
    """The run signals itself as its bar reaches `count` micro-batches (inside that step's gradients): a moment of
    the run, not of the clock. Forked runs inherit it; monkeypatch.undo() before a run that must not."""
    update = console.Bar.update

    def update_then_signal(self, n=1):
        update(self, n)
        if self.tqdm.n == count:
            os.kill(os.getpid(), sig)
    monkeypatch.setattr(console.Bar, "update", update_then_signal)
