"""The non-finite step guard, the agreement of every rank once per optimizer step.

The loop calls `StepGuard.check` once per optimizer step, between clipping and the optimizer step: one small
all-reduce tells every rank whether any rank saw a non-finite loss or gradient norm (skip the step), whether the
fp16 scaler found an inf on any rank, whether any rank was signalled (stop after this step; the signals are
trainer/runtime/signals.py's) and whether a checkpoint is due by --save_every_minutes on any rank, so all ranks skip,
back off the loss scale, save and stop at the same step; it also sums the step's loss for the progress bar. The
data-parallel replica check is the dp module's (parallel/data.py).
"""
import signal
import time

import torch
import torch.distributed as dist

from model.torch_compat import scaler_found_inf_per_device
from trainer.base.errors import TrainingHalted
from trainer.base.log import Logger


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
