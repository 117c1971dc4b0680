"""What keeps a run sane: preemption signals, the non-finite step guard, the data-parallel replica check.

The loop calls `StepGuard.check` once per optimizer step, between clipping and the optimizer step: one small
all-reduce tells every rank whether any rank saw a non-finite loss or gradient norm (skip the step), whether the
fp16 scaler found an inf on any rank, and whether any rank was signalled (stop after this step), so all ranks skip,
back off the loss scale and stop at the same step.
"""
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from trainer.launch import TrainingHalted, local_tensor
from trainer.parallel.state_dict import clean_fqn
from trainer.trainer_utils import Logger


class Preemption:
    """SIGTERM/SIGINT ask the loop to stop after the current optimizer step; a second SIGINT aborts at once.

    Past `grace_seconds` after the first signal the process exits 124 (saves are atomic: nothing half-written
    looks valid). Used as a context manager around the loop; the previous handlers come back on exit."""

    def __init__(self, grace_seconds):
        self.grace_seconds, self.requested, self.timer, self.previous = grace_seconds, None, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.timer is not None:
            self.timer.cancel()

    def _handle(self, signum, frame):
        if self.requested is not None:
            if signum == signal.SIGINT:
                print("error: second SIGINT: aborted at once, without a checkpoint of this step", file=sys.stderr,
                      flush=True)
                os._exit(130)
            return
        self.requested = signal.Signals(signum).name
        print(f"{self.requested}: finishing this optimizer step, then saving a checkpoint "
              f"(--grace_seconds {self.grace_seconds})", flush=True)
        self.timer = threading.Timer(self.grace_seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _expire(self):
        print(f"error: {self.requested}: the step and its checkpoint did not finish within --grace_seconds "
              f"{self.grace_seconds}; exiting without them", file=sys.stderr, flush=True)
        os._exit(124)


class StepGuard:
    """Skips optimizer steps whose loss or gradient norm is non-finite on any rank, counts them, and stops the run
    after `max_bad_steps` in a row; also carries the agreed preemption stop."""

    def __init__(self, max_bad_steps, preemption=None):
        self.max_bad_steps, self.preemption = max_bad_steps, preemption
        self.skipped_steps = self.in_a_row = 0
        self.stop = False
        self.last_good_save = None  # global step of the last checkpoint saved outside a run of skipped steps
        self.last_loss = None  # this rank's loss of the last step, read with the check's flags (for the bar)

    def check(self, loss, grad_norm, check_norm, device, found_inf=None):
        """True when this step must be skipped; sets self.stop when any rank was signalled (collective).

        found_inf: the fp16 scaler's per-device found-inf tensors (scaler_found_inf), set to the value agreed over
        every rank, so that all ranks skip the step and lower the scale together (each sees only its own grads)."""
        loss = torch.as_tensor(loss, dtype=torch.float32, device=device)
        bad = ~torch.isfinite(loss)
        if check_norm:  # under the fp16 scaler an inf gradient norm is the scaler's (it skips and lowers the scale)
            bad = bad | ~torch.isfinite(torch.as_tensor(grad_norm, device=device))
        signalled = self.preemption is not None and self.preemption.requested is not None
        inf = sum((t.to(device=device, dtype=torch.float32) for t in found_inf or ()), torch.zeros((), device=device))
        flags = torch.stack([bad.float(), torch.tensor(float(signalled), device=device), (inf > 0).float()])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        skip, stop, any_inf, self.last_loss = torch.cat([flags, loss.reshape(1)]).tolist()  # the step's one host sync
        for tensor in found_inf or ():
            tensor.fill_(any_inf)
        self.stop = stop > 0
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
        if self.in_a_row == 0:
            self.last_good_save = step


def scaler_found_inf(scaler, optimizer):
    """The fp16 GradScaler's found-inf tensors of this step (after unscale_), for StepGuard.check; None when off.

    torch all-reduces found-inf over a DTensor gradient's mesh only (DTensor's found_inf_reduce_handler), never
    across pipeline stages or plain-tensor layouts, hence the guard's agreement over every rank."""
    if not scaler.is_enabled():
        return None
    return list(scaler._found_inf_per_device(optimizer).values())  # private, in every torch 2.x (2.11 too)


def replica_checksums(model_parts):
    """(names, tensor [n, 2]): float64 sum and sum of squares of each parameter's local values."""
    names, sums = [], []
    for part in model_parts:
        for name, param in part.named_parameters():
            local = local_tensor(param.detach()).double()
            names.append(clean_fqn(name))
            sums.append(torch.stack([local.sum(), (local * local).sum()]))
    return names, torch.stack(sums)


def check_replicas(model_parts, group, step):
    """Raise TrainingHalted naming the first parameter whose checksum differs across the replicas of `group`."""
    names, mine = replica_checksums(model_parts)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for i, name in enumerate(names):
        ranks = [r for r, other in enumerate(gathered) if not torch.equal(other[i], gathered[0][i])]
        if ranks:
            raise TrainingHalted(f"--check_replicas: at step {step} parameter {name} differs between data-parallel "
                                 f"replicas (group ranks {ranks} vs 0); the replicas diverged, resume from the last "
                                 "checkpoint and look for non-deterministic or rank-dependent code")
