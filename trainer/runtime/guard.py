"""What keeps a run sane: preemption signals, the non-finite step guard and the one line an out-of-memory error
ends a run with (the end of this file); the data-parallel replica check is the dp module's (parallel/data.py).

The loop calls `StepGuard.check` once per optimizer step, between clipping and the optimizer step: one small
all-reduce tells every rank whether any rank saw a non-finite loss or gradient norm (skip the step), whether the
fp16 scaler found an inf on any rank, whether any rank was signalled (stop after this step) and whether a
checkpoint is due by --save_every_minutes on any rank, so all ranks skip, back off the loss scale, save and stop at
the same step; it also sums the step's loss for the progress bar. One process does not wait for the step: a signal
during its micro-batches drops them (Preemption.abandonable).
"""
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from model.torch_compat import scaler_found_inf_per_device
from trainer.base.errors import TrainingHalted
from trainer.base.launch import rank
from trainer.base.log import Logger, say
from trainer.base.streams import write_fd
from trainer.ckpt.checkpoint import latest_checkpoint
from trainer.observe.metrics import peak_mem_gb
from trainer.parallel.perf import decoder_blocks


class StepAbandoned(Exception):
    """A signal came while one process ran a step's micro-batches: the step is dropped, the last completed one saved."""


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


class StepGuard:
    """Skips optimizer steps whose loss or gradient norm is non-finite on any rank, counts them, and stops the run
    after `max_bad_steps` in a row; also carries the agreed preemption stop and the agreed time-based save."""

    def __init__(self, max_bad_steps, preemption=None, save_every_s=0):
        self.max_bad_steps, self.preemption, self.save_every_s = max_bad_steps, preemption, save_every_s
        self.skipped_steps = self.in_a_row = 0
        self.stop = self.save_due = False
        self.stop_signal = None  # the signal every rank agreed to stop on (SIGTERM where any rank had one)
        self.last_good_save = self.last_save = None  # global step of the last checkpoint (outside skipped steps)
        self.last_loss = None  # the step's loss summed over ranks, read with the check's flags (for the bar)
        self.saved_at = self.checked_at = time.monotonic()

    def check(self, loss, grad_norm, check_norm, device, found_inf=None, shown_loss=None):
        """True when this step must be skipped; sets self.stop when any rank was signalled and self.save_due when a
        checkpoint is due by time on any rank (collective: the step's one host sync).

        found_inf: the fp16 scaler's per-device found-inf tensors (scaler_found_inf), set to the value agreed over
        every rank, so that all ranks skip the step and lower the scale together (each sees only its own grads).
        shown_loss: this rank's share of the logged loss (0 where it does not count), summed into last_loss."""
        loss = torch.as_tensor(loss, dtype=torch.float32, device=device)
        bad = ~torch.isfinite(loss)
        if check_norm:  # under the fp16 scaler an inf gradient norm is the scaler's (it skips and lowers the scale)
            bad = bad | ~torch.isfinite(torch.as_tensor(grad_norm, device=device))
        requested = self.preemption.requested if self.preemption is not None else None
        if self.preemption is not None:
            self.preemption.finishing = False  # a signal from here on drops the next step as it begins
        now = time.monotonic()  # due when the next step would end past --save_every_minutes since the last save
        due = bool(self.save_every_s) and now - self.saved_at + (now - self.checked_at) > self.save_every_s
        self.checked_at = now
        inf = sum((t.to(device=device, dtype=torch.float32) for t in found_inf or ()), torch.zeros((), device=device))
        shown = torch.as_tensor(loss if shown_loss is None else shown_loss, dtype=torch.float32, device=device)
        flags = torch.tensor([float(requested is not None), float(requested == "SIGTERM"), float(due)], device=device)
        flags = torch.cat([bad.float().reshape(1), (inf > 0).float().reshape(1), flags, shown.reshape(1)])
        if dist.is_initialized():
            dist.all_reduce(flags)  # sums: a flag is set on some rank when its sum is above 0
        skip, any_inf, stop, sigterm, save_due, self.last_loss = flags.tolist()  # the step's one host sync
        for tensor in found_inf or ():
            tensor.fill_(float(any_inf > 0))
        self.stop, self.save_due = stop > 0, save_due > 0
        if self.stop:
            self.stop_signal = signal.SIGTERM if sigterm > 0 else signal.SIGINT
        return skip > 0

    def record(self, skipped, progress, num_microbatches, loss, grad_norm):
        """Count a skipped step and say where it was; raise TrainingHalted after max_bad_steps in a row."""
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped_steps += 1
        self.in_a_row += 1
        first = progress.step_in_epoch * num_microbatches
        Logger(f"step {progress.global_step}: non-finite loss ({float(loss):.4g}) or gradient norm "
               f"({float(grad_norm):.4g}) on some rank; skipped the optimizer step (epoch {progress.epoch + 1}, "
               f"micro-batches {first}-{first + num_microbatches - 1} of the epoch)")
        if self.in_a_row >= self.max_bad_steps:
            last = (f"step {self.last_good_save}" if self.last_good_save is not None else "none saved by this run")
            raise TrainingHalted(f"{self.in_a_row} optimizer steps in a row (to step {progress.global_step}) had a "
                                 f"non-finite loss or gradient norm (--max_bad_steps {self.max_bad_steps}); the last "
                                 f"good checkpoint is {last}; lower --learning_rate or check the data, then resume")

    def saved(self, step):
        """A checkpoint of `step` is written: the time-based save counts from now."""
        self.last_save, self.saved_at = step, time.monotonic()
        if self.in_a_row == 0:
            self.last_good_save = step


def scaler_found_inf(scaler, optimizer):
    """The fp16 GradScaler's found-inf tensors of this step (after unscale_), for StepGuard.check; None when off.

    torch all-reduces found-inf over a DTensor gradient's mesh only (DTensor's found_inf_reduce_handler), never
    across pipeline stages or plain-tensor layouts, hence the guard's agreement over every rank."""
    if not scaler.is_enabled():
        return None
    return list(scaler_found_inf_per_device(scaler, optimizer).values())


# ----------------------------------------------------------------------------- out of memory
# Out of memory during training, on any rank: one `error:` line from that rank with the step, its peak memory and what
# to change, then the rank leaves (exit 3) and torchrun stops the others; checkpoints are only ever complete or
# ignored, so the last complete one stays usable. CPU: MemoryError or the allocator's RuntimeError; CUDA:
# torch.cuda.OutOfMemoryError.
CPU_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")


class OutOfMemory(TrainingHalted):
    """An allocation failed: said by the rank it failed on (the others may be waiting in a collective)."""
    every_rank = True


def is_out_of_memory(error):
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in CPU_MESSAGES)


def advice(plan):
    """What to change, most direct first, for this run's layout."""
    changes = [f"lower --batch_size (now {plan.data.micro_batch}; raise --accumulation_steps to keep the global batch)"]
    if plan.model.grad_checkpointing != "full":
        changes.append("--grad_checkpointing full")
    if plan.layout.dp * plan.layout.cp > 1 and plan.layout.zero_stage < 3:
        changes.append(f"--zero_stage {plan.layout.zero_stage + 1} (shards more state over the data-parallel ranks)")
    if plan.layout.dp_mode == "fsdp2" and plan.layout.device.startswith("cuda") and not plan.layout.cpu_offload:
        changes.append("--cpu_offload 1")
    if not plan.model.chunked_loss and plan.layout.tp == 1 and plan.layout.pp == 1:
        changes.append("--loss_chunk_size 1024")
    return ", ".join(changes[:-1]) + f" or {changes[-1]}" if len(changes) > 1 else changes[0]


def what_failed(error):
    """The allocator's words, without the C++ source location: "DefaultCPUAllocator: can't allocate memory: ..."."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", first)[:200]


@contextmanager
def out_of_memory_as_one_line(trainer):
    """Around the loop: an allocation failure becomes OutOfMemory with the line that says what to do."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        plan, progress = trainer.plan, trainer.progress
        kind = "CUDA" if isinstance(e, torch.cuda.OutOfMemoryError) else "CPU"
        last, peak = latest_checkpoint(plan.io.run_dir), peak_mem_gb(plan.layout.device)
        raise OutOfMemory(
            f"out of {kind} memory on rank {rank()} in step {progress.global_step + 1} (peak {peak:.2f} GiB on this "
            f"rank; {what_failed(e)}): {advice(plan)}; the last complete checkpoint is "
            f"{last or 'none yet'}" + (", continue with --from_resume 1" if last else "")) from None
