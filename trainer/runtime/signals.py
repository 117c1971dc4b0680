"""Preemption signals: SIGTERM/SIGINT stop a run with a checkpoint of its last completed optimizer step (Preemption,
a context manager around the loop), one process drops the unfinished step at once (StepAbandoned), and the
gradient hooks that let a handler run between decoder blocks in backward; the agreement between ranks on the stop is
the step guard's (trainer/runtime/step_guard.py)."""
import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch

from trainer.base.log import Logger, say
from trainer.base.streams import write_fd
from trainer.ckpt.weights_file import save_last_completed
from trainer.parallel.perf import decoder_blocks


class StepAbandoned(Exception):
    """A signal came while one process ran a step's micro-batches: the step is dropped, the last completed one saved."""


def save_abandoned(trainer):
    """A signal during a step's micro-batches (one process): drop their gradients and save the last completed step,
    whose parameters, optimizer state and progress are untouched, with the RNG state it ended with."""
    guard = trainer.guard
    guard.stop, guard.stop_signal = True, signal.Signals[guard.preemption.requested]
    step = save_last_completed(trainer)
    if step == 0:
        Logger("preempted: no optimizer step completed yet; nothing to save")
        return
    Logger(f"preempted: dropped step {step + 1}; step {step} saved in {trainer.plan.io.run_dir}; "
           "continue with --from_resume 1")


class Preemption:
    """SIGTERM/SIGINT stop the run with a checkpoint of the last completed optimizer step; a second SIGINT aborts.

    One process (`abandon`): inside `abandonable()` (a step's data and micro-batches, before its optimizer step) the
    signal raises StepAbandoned at once, since the parameters and optimizer are still the last completed step's.
    Several ranks: the signal may reach one rank only, and a rank leaving a step early would hang the others in
    its collectives, so they finish the step and stop together (StepGuard.check agrees on it). Past
    `grace_seconds` after the first signal the process exits 124 (saves are atomic: nothing half-written looks
    valid). Used as a context manager around the loop; the previous handlers come back on exit."""

    def __init__(self, grace_seconds, abandon=False):
        self.grace_seconds, self.abandon = grace_seconds, abandon
        self.requested, self.timer, self.previous, self.in_step, self.finishing = None, None, {}, False, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.timer is not None:
            self.timer.cancel()

    @contextmanager
    def abandonable(self, gradients=False):
        """Within (one process): a signal, or one that came before, drops the step at once (StepAbandoned).

        gradients: the block computes the step's gradients; once it is through, a signal lets the step finish
        (StepGuard.check sees it), until the check (`finishing`): the first line says which will happen."""
        if self.abandon and self.requested is not None:
            raise StepAbandoned(self.requested)
        self.in_step = self.abandon
        try:
            yield
        finally:
            self.in_step = False
        self.finishing = gradients

    def _handle(self, signum, frame):
        if self.requested is not None:
            if signum == signal.SIGINT:
                say_from_handler("error: second SIGINT: aborted at once, without a checkpoint of this step", sys.stderr)
                os._exit(130)
            return
        self.requested = signal.Signals(signum).name
        # several ranks always finish the step; one process drops it unless its gradients are complete (then the
        # guard's check, next, sees the signal); between steps, the next one's first abandonable() drops it
        what = ("finishing this optimizer step, then saving a checkpoint" if not self.abandon or self.finishing else
                "dropping the unfinished optimizer step, saving the last completed one")
        say_from_handler(f"{self.requested}: {what} (--grace_seconds {self.grace_seconds})")
        self.timer = threading.Timer(self.grace_seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()
        if self.in_step:
            raise StepAbandoned(self.requested)

    def _expire(self):
        print(f"\nerror: {self.requested}: the step and its checkpoint did not finish within --grace_seconds "
              f"{self.grace_seconds}; exiting without them", file=sys.stderr, flush=True)
        os._exit(124)


def say_from_handler(text, file=None):
    """say() from a signal handler. It runs on the main thread between two of its bytecodes, which may be inside a
    write to the same stream (a log line, a warning printed during a save), and a buffered writer refuses the second,
    reentrant write (RuntimeError): the line then goes straight to the stream's file descriptor."""
    try:
        say(text, file)
    except RuntimeError as e:
        if "reentrant" not in str(e):
            raise
        write_fd((file or sys.stdout).fileno(), f"\n{text}\n")


def add_signal_points(model_parts):
    """One process: a pass-through gradient hook on each decoder block's output, so that a signal's handler runs
    (and drops the step) between blocks in backward; the CPU autograd engine runs no Python code otherwise, and a
    signal waited for the whole backward of a micro-batch (10-18 s of the default model on 2 cores)."""
    for part in model_parts:
        for block in decoder_blocks(part):
            block.register_forward_hook(_hook_output)


def _hook_output(module, args, output):
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_pass_gradient)


def _pass_gradient(grad):
    return grad
