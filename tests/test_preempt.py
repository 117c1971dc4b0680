"""Preemption (trainer/runtime/signals.py Preemption + the loop): SIGTERM/SIGINT leave a checkpoint of the last
completed step (one process drops the step in progress at once; several ranks finish it and stop at the same step);
resuming reproduces the uninterrupted run's losses and weights."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics
from tests.helpers.preempt_runs import (
    SCRIPT,
    finish,
    metrics_path,
    rank_pid,
    run_args,
    signal_at_micro_batch,
    start,
    wait_for_step,
)
from trainer.ckpt.checkpointer import Checkpointer
from trainer.core import data_loading
from trainer.runtime.signals import Preemption, StepAbandoned
from trainer.runtime.step_guard import StepGuard


@pytest.mark.parametrize("nproc,sig", [(1, signal.SIGTERM), (2, signal.SIGTERM)])
def test_signal_saves_at_the_step_reached_and_resume_is_exact(tmp_path, nproc, sig):
    data = demo_slice(tmp_path, "pretrain", 200)
    max_steps = 90
    argv = run_args(tmp_path, "split", data, max_steps)
    proc, log = start(argv, nproc)
    wait_for_step(proc, argv, 2)
    # under torchrun only rank 1 is signalled: rank 0 must learn it through the per-step agreement
    os.kill(proc.pid if nproc == 1 else rank_pid(proc, 1), sig)
    code, output = finish(proc, log)
    if nproc == 1:  # a stopped run is not a finished one: `train && next_stage` stops
        assert code == 128 + sig, output[-3000:]
    else:  # torchrun fails (1) and names each worker's exit code: every rank exits 128 + signum
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", output)
        assert code != 0 and codes and set(codes) == {str(128 + sig)}, output[-3000:]
    stopped = read_metrics(metrics_path(argv))
    reached = stopped[-1]["step"]
    assert 2 <= reached < max_steps and [r["step"] for r in stopped] == list(range(1, reached + 1))
    if nproc == 1 and f"{sig.name}: dropping the unfinished optimizer step" in output:  # inside a step's batches
        assert f"preempted: dropped step {reached + 1}; step {reached} saved" in output
    elif nproc == 1:  # between a step's last backward and its save (optimizer step, records): the step completes
        assert f"{sig.name}: finishing this optimizer step" in output
        assert f"preempted: stopped at step {reached} with its checkpoint" in output
    else:
        assert f"{sig.name}: finishing this optimizer step" in output  # said by the signalled rank
        assert f"preempted: stopped at step {reached} with its checkpoint" in output
    assert "Done:" not in output
    end = reached + 4
    resume = run_args(tmp_path, "split", data, end) + ["--from_resume", "1"]
    resumed = forked(SCRIPT, resume, nproc, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {reached}" in resumed.stdout.split("Resumed from", 1)[1].splitlines()[0]  # the checkpoint's step
    ref_argv = run_args(tmp_path, "full", data, end) + (["--check_replicas", "1"] if nproc > 1 else [])
    ref = forked(SCRIPT, ref_argv, nproc, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    full, split = read_metrics(metrics_path(ref_argv)), read_metrics(metrics_path(argv))
    assert [r["step"] for r in split] == [r["step"] for r in full] == list(range(1, end + 1))
    for a, b in zip(full, split):  # same process count, same reduction order: equal to fp32 rounding
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], (a, b)


def test_sigint_in_a_long_step_saves_the_last_completed_step_at_once(tmp_path, monkeypatch):
    """Steps of 20 micro-batches: a SIGINT at step 3's tenth micro-batch drops step 3 there, runs no micro-batch more
    (the old loop finished step 3 first: the bar would end at 60) and saves step 2; --from_resume 1 continues exactly
    as the uninterrupted run."""
    data = demo_slice(tmp_path, "pretrain", 400)
    long_steps = ["--max_seq_len", "64", "--batch_size", "4", "--accumulation_steps", "20"]
    argv = run_args(tmp_path, "split", data, 5) + long_steps
    signal_at_micro_batch(monkeypatch, 50, signal.SIGINT)
    proc, log = start(argv, 1)
    code, output = finish(proc, log)
    monkeypatch.undo()
    assert code == 130, output[-3000:]
    assert "SIGINT: dropping the unfinished optimizer step" in output and "Done:" not in output, output[-2000:]
    assert "preempted: dropped step 3; step 2 saved" in output, output[-2000:]
    assert re.findall(r"(\d+)/100 \[", output)[-1] == "50", output[-2000:]  # the bar's last count: at once
    # the handler's and the loop's lines start lines of their own (tqdm clears the bar's line first), the bar is the
    # same file's stderr: a print would have glued them onto the bar's text
    pieces = re.split(r"[\r\n]", output)
    for needle in ("SIGINT: dropping", "preempted: dropped", "step 2 | epoch"):
        assert [p for p in pieces if needle in p] and all(p.startswith(needle) for p in pieces if needle in p), needle
    records = read_metrics(metrics_path(argv))
    assert [r["step"] for r in records] == [1, 2]
    assert sorted(os.listdir(os.path.join(str(tmp_path), "split", "ckpt", "pretrain_64"))) == ["step_2"]
    resumed = forked(SCRIPT, run_args(tmp_path, "split", data, 5) + long_steps + ["--from_resume", "1"])
    assert resumed.returncode == 0 and "Done: 5 steps" in resumed.stdout, resumed.stderr[-3000:]
    assert "Resumed from epoch 0, step 2" in resumed.stdout
    ref = forked(SCRIPT, run_args(tmp_path, "full", data, 5) + long_steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    full = read_metrics(os.path.join(str(tmp_path), "full", "metrics.jsonl"))
    assert [(r["step"], r["loss"], r["tokens"]) for r in read_metrics(metrics_path(argv))] == \
        [(r["step"], r["loss"], r["tokens"]) for r in full]  # bitwise: same process, same order of sums
    weights = [torch.load(os.path.join(str(tmp_path), run, "pretrain_64.pth")) for run in ("split", "full")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])


def test_grace_period_and_second_sigint_exit_non_zero(tmp_path, monkeypatch):
    data = demo_slice(tmp_path, "pretrain", 200)
    argv = run_args(tmp_path, "grace", data, 90) + ["--grace_seconds", "0.001"]
    proc, log = start(argv, 1)
    wait_for_step(proc, argv, 2)
    os.kill(proc.pid, signal.SIGTERM)
    code, output = finish(proc, log)
    assert code == 124 and "error: SIGTERM: the step and its checkpoint did not finish within --grace_seconds 0.001" \
        in output, output[-2000:]
    # the first SIGINT in step 3's gradients; the second as the dropped step's save begins (a moment of the run)
    signal_at_micro_batch(monkeypatch, 3, signal.SIGINT)
    save = Checkpointer.save

    def signal_then_save(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return save(self, *args, **kwargs)
    monkeypatch.setattr(Checkpointer, "save", signal_then_save)
    argv = run_args(tmp_path, "twice", data, 90)
    proc, log = start(argv, 1)
    code, output = finish(proc, log)
    assert code == 130 and "error: second SIGINT: aborted at once" in output, output[-2000:]
    assert "preempted:" not in output


@pytest.mark.parametrize("moment,line,dropped", [
    ("batches", "dropping the unfinished optimizer step", True),  # the step's gradients are incomplete: dropped now
    ("gradients_done", "finishing this optimizer step", False),  # the check sees it: the step completes and stops
    ("checked", "dropping the unfinished optimizer step", True),  # the next step is dropped as it begins
])
def test_the_first_line_says_what_the_signal_will_do(moment, line, dropped, capsys):
    """One process, SIGTERM at each moment of a step (the loop's calls in its order: data, gradients, the guard's
    check, the next step's data): the line printed at once predicts what the loop then does."""
    preemption = Preemption(60, abandon=True)
    guard = StepGuard(5, preemption)

    def signal_at(point):
        if point == moment:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on this thread before the next line
    outcome = None
    with preemption:
        try:
            with preemption.abandonable():
                pass  # the step's data
            with preemption.abandonable(gradients=True):
                signal_at("batches")
            signal_at("gradients_done")
            guard.check(1.0, 1.0, True, "cpu")
            if guard.stop:  # the loop saves this step and stops (should_stop)
                outcome = "stopped"
            else:
                signal_at("checked")
                with preemption.abandonable():
                    pass  # the next step's data
        except StepAbandoned:
            outcome = "dropped"
    assert outcome == ("dropped" if dropped else "stopped")
    assert capsys.readouterr().out.startswith(f"SIGTERM: {line}")


REENTRANT_WRITE = """
import io, os, signal, sys
sys.path.insert(0, {root!r})
from trainer.runtime.signals import Preemption

class Raw(io.RawIOBase):  # stderr's file descriptor, and the signal arriving inside the buffered writer's write
    def __init__(self, signal_first):
        self.signal_first = signal_first
    def writable(self):
        return True
    def fileno(self):
        return 2
    def write(self, data):
        arrive, self.signal_first = self.signal_first, None
        if arrive:
            arrive()
        return os.write(2, data)

preemption = Preemption(60, abandon=True)
preemption.requested = "SIGINT"  # the first SIGINT came before
sys.stderr = io.TextIOWrapper(io.BufferedWriter(Raw(lambda: preemption._handle(signal.SIGINT, None))))
print("a warning printed during the save", file=sys.stderr, flush=True)
"""


def test_a_signal_inside_a_write_to_the_same_stream_still_says_its_line(tmp_path):
    """A second SIGINT whose handler runs while the main thread is inside a write to stderr (CI: a warning printed by
    the save of the dropped step): the buffered writer refuses the handler's reentrant write, so the line goes to the
    file descriptor, and the exit code is the abort's, 130, not a traceback's 1."""
    script = tmp_path / "reentrant_write.py"
    script.write_text(REENTRANT_WRITE.format(root=ROOT))
    proc = forked(str(script), [], timeout=60)  # forked: torch imported already
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip() == "error: second SIGINT: aborted at once, without a checkpoint of this step"


def test_ctrl_c_under_a_pipe_whose_reader_died_still_saves(tmp_path):
    """`python train_pretrain.py | tee log` and Ctrl-C: the shell's SIGINT kills tee too, and the next write to the
    pipe (the signal's own line, the bar) raised BrokenPipeError and ended the run without a checkpoint. Here the
    pipe's reader closes it, then SIGINT: the run still saves its last completed step and exits 130."""
    data = demo_slice(tmp_path, "pretrain", 200)
    argv = run_args(tmp_path, "piped", data, 90)
    os.makedirs(os.path.dirname(metrics_path(argv)), exist_ok=True)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, SCRIPT), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        lines = []
        for line in proc.stdout:  # the reader (tee) is alive up to step 2
            lines.append(line)
            if b"step 2 |" in line:
                break
        proc.stdout.close()  # tee dies
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130, b"".join(lines)[-2000:]
    ckpt = os.path.join(str(tmp_path), "piped", "ckpt", "pretrain_64")
    saved = sorted(d for d in os.listdir(ckpt) if os.path.exists(os.path.join(ckpt, d, "complete.json")))
    assert saved and int(saved[-1].split("_")[1]) >= 2, saved
    assert os.path.exists(os.path.join(str(tmp_path), "piped", "pretrain_64.pth"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_demo_corpus_is_built_is_one_line(tmp_path, monkeypatch, sig):
    """Ctrl-C in the first seconds (the demo corpus is built): one line and exit 128 + signum, not a 30-line
    KeyboardInterrupt traceback (SIGINT) or a silent death by the signal (SIGTERM)."""
    def building(kind, *args, **kwargs):  # the build, with the user's signal arriving during it
        os.kill(os.getpid(), sig)
        time.sleep(30)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the build")
    monkeypatch.setattr(data_loading, "ensure_demo_data", building)  # the forked run inherits it
    out = os.path.join(str(tmp_path), "early")
    run = forked(SCRIPT, [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt")], timeout=120)
    assert run.returncode == 128 + sig, run.stderr[-3000:]
    assert run.stderr.strip() == f"{sig.name}: stopped before the first optimizer step; nothing was saved", run.stderr


def test_from_resume_1_without_a_checkpoint_fails_before_the_data_is_built(tmp_path, monkeypatch):
    """--from_resume 1 with nothing to resume: exit 2 at once, before the corpus is built and tokenized (it took 59 s
    to say so)."""
    def building(kind, *args, **kwargs):
        raise AssertionError("the data was built before the resume check")
    monkeypatch.setattr(data_loading, "ensure_demo_data", building)
    out = os.path.join(str(tmp_path), "none")
    run = forked(SCRIPT, [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt"),
                          "--from_resume", "1"], timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "holds no complete checkpoint" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
