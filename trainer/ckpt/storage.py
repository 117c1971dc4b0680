"""Disk space around every write of the trainer: room checked before it, a write that fills the disk as one line.

Checkpoints (every rank) go through check_room + disk_full_as_one_line; rank 0's own files (weights, adapters, the
DPO reference cache) through rank0_write, which does both around the write and tells every rank the outcome. The
atomic writers of model/atomic.py leave no temporary file behind a failed write.

A full disk does not surface as ENOSPC from a DCP save: FileSystemWriter's torch.save stream fails with
RuntimeError "unexpected pos N vs M", which dcp.save wraps in a CheckpointException (a BaseException) carrying
each rank's (exception, traceback) in .failures. So a failed save counts as a full disk when ENOSPC / EDQUOT /
EFBIG appears anywhere in the exception chain or the failures, or when the directory is all but full afterwards.
"""
import os
import shutil
from contextlib import contextmanager

import torch.distributed as dist

from model.atomic import full_disk_reason
from trainer.base.errors import TrainingHalted
from trainer.base.log import Logger

NEARLY_FULL_BYTES = 1 << 20  # free space below this after a failed write: the write filled the disk
FP32_WEIGHT_BYTES, ADAM_MOMENT_BYTES = 4, 8  # per parameter in a resume checkpoint: fp32 weight, exp_avg + exp_avg_sq


class DiskFullError(TrainingHalted):
    """A checkpoint does not fit (or did not fit) its directory: one line, exit code 3."""


def _existing(path):
    """`path` or its nearest existing parent: where the space of a directory not yet made is counted."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(directory):
    """Bytes this user may still write under `directory` (created or not)."""
    return shutil.disk_usage(_existing(directory)).free


def tree_bytes(path):
    """Total size of the files under `path` (0 when absent)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass  # removed meanwhile (a prune)
    return total


def checkpoint_bytes_estimate(model, save_dtype_bytes):
    """A resume checkpoint (fp32 weights + Adam's two moments) plus the weights file in --save_dtype, in bytes.

    Weights count per state-dict entry (a tied embedding is saved twice), moments per parameter.
    """
    saved = sum(v.numel() for v in model.state_dict().values())
    params = sum(p.numel() for p in model.parameters())
    return saved * (FP32_WEIGHT_BYTES + save_dtype_bytes) + params * ADAM_MOMENT_BYTES


def checkpoint_room(model, plan):
    """The bytes one checkpoint of `model` takes (checkpoint_bytes_estimate, plus each dp rank's fp32 PowerSGD
    residuals under --grad_compression powersgd); logs room_warning's line when --checkpoint_dir lacks them."""
    estimate = checkpoint_bytes_estimate(model, plan.io.save_dtype.itemsize)
    if plan.layout.grad_compression == "powersgd" and plan.layout.dp > 1:  # each rank's fp32 residuals beside it
        estimate += plan.layout.dp * FP32_WEIGHT_BYTES * sum(p.numel() for p in model.parameters() if p.requires_grad)
    warning = room_warning(plan.io.checkpoint_dir, estimate)
    if warning:
        Logger(warning)
    return estimate


def mib(num_bytes):
    """'12.3 MiB': bytes in mebibytes (2**20 bytes), the unit of every size line about checkpoints."""
    return f"{num_bytes / 2**20:.1f} MiB"


def room_line(directory, needed, free, last_complete, what="a checkpoint", flag="--checkpoint_dir"):
    """The one line for `what` (a checkpoint, a weights file) of `needed` bytes that does not fit `free` bytes of
    `directory`; `flag` chooses the directory."""
    last = f"the last complete checkpoint is {last_complete}" if last_complete else "no complete checkpoint yet"
    then = "resume with --from_resume 1" if last_complete else "run again"
    return (f"disk full: {directory} needs {mib(needed)} for {what} but has {mib(free)} free; {last}; "
            f"free space or choose another {flag}, then {then}")


def room_error(directory, needed, last_complete=None, what="a checkpoint", flag="--checkpoint_dir"):
    """room_line when `directory` has less than `needed` bytes free, else None."""
    free = free_bytes(directory)
    return room_line(directory, needed, free, last_complete, what, flag) if free < needed else None


def room_warning(directory, needed):
    """A warning line before training when `directory` cannot hold one checkpoint of `needed` bytes, else None."""
    free = free_bytes(directory)
    if free >= needed:
        return None
    return (f"warning: {directory} has {mib(free)} free, less than one checkpoint (~{mib(needed)}): "
            "saves will fail; free space or choose another --checkpoint_dir")


def _is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def from_rank0(value):
    """Rank 0's `value` on every rank (a collective without a process group: the value itself)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_room(directory, needed, last_complete=None):
    """Raise DiskFullError when rank 0 finds less than `needed` bytes free; every rank raises (a collective)."""
    # one decision for all ranks: none may enter the save while another stops
    line = from_rank0(room_error(directory, needed, last_complete) if _is_rank0() else None)
    if line:
        raise DiskFullError(line)


def rank0_write(directory, needed, what, flag, write, last_complete=None):
    """Rank 0 runs write(), which puts about `needed` bytes under `directory`: too little room beforehand, or a disk
    that fills during it, is one DiskFullError naming `what` and `flag`; every rank learns rank 0's outcome (a
    collective) and stops with it, so none waits on a rank that stopped."""
    outcome, failure = None, None  # (line, a full disk or not)
    if _is_rank0():
        try:
            line = room_error(directory, needed, last_complete, what, flag)
            outcome = (line, True) if line else None
            if line is None:
                with disk_full_as_one_line(directory, needed, last_complete, what=what, flag=flag):
                    write()
        except Exception as e:  # told to the other ranks below, then raised here
            failure = e
            full = isinstance(e, DiskFullError)
            outcome = (str(e) if full else f"rank 0 failed writing {what} ({type(e).__name__})", full)
    outcome = from_rank0(outcome)
    if failure is not None:
        raise failure
    if outcome:
        raise (DiskFullError if outcome[1] else TrainingHalted)(outcome[0])


def _chain(exc):
    """`exc`, its causes and contexts, and the per-rank failures of a DCP CheckpointException, recursively."""
    seen, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values() if isinstance(pair, tuple)]
    return seen


def is_disk_full(exc, directory):
    """Whether `exc`, raised while writing under `directory`, comes from a full disk (see the module docstring)."""
    if any(full_disk_reason(e) for e in _chain(exc)):  # an OSError of FULL_ERRNOS, or safetensors' wording of one
        return True
    return not isinstance(exc, (KeyboardInterrupt, SystemExit)) and free_bytes(directory) < NEARLY_FULL_BYTES


@contextmanager
def disk_full_as_one_line(directory, needed, last_complete=None, partial=None, what="a checkpoint",
                          flag="--checkpoint_dir"):
    """Turn an error of the save inside the block into DiskFullError when the disk is full; others pass as raised.

    partial: the step directory being written; its files count as free space in the line (they were before the save).
    """
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, DiskFullError) or not is_disk_full(e, directory):
            raise
        free = free_bytes(directory) + (tree_bytes(partial) if partial else 0)
        raise DiskFullError(room_line(directory, needed, free, last_complete, what, flag)) from e
