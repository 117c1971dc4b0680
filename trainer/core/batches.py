"""A loader batch on its way into the model, the same for training and validation: targets shifted from the labels,
device copies, each context-parallel rank's part of the sequence, autocast."""
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from trainer.parallel.mesh import dimension_module


def to_device(tensor, device):
    """A CPU batch tensor on the device (None stays None); non-blocking, as the loader pins on CUDA."""
    return None if tensor is None else tensor.to(device, non_blocking=True)


def step_targets(labels):
    """Targets aligned with inputs: labels shifted left by one, -100 appended (so sequences can be sharded)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def shard_for_context(dims, tensors, position_ids=None):
    """Context parallel: each rank keeps its head+tail chunks of the sequence, plus their positions.

    position_ids: a packed batch's per-document positions (--doc_mask), sharded like the tokens, else None."""
    if dims.size("cp") == 1:
        return tensors, position_ids
    rank, size, context = dims.rank("cp"), dims.size("cp"), dimension_module("cp")
    if position_ids is not None:
        positions = context.shard_sequence(position_ids, rank, size, dim=1)
    else:
        positions = context.context_position_ids(tensors[0].shape[1], rank, size, tensors[0].device)  # (1, L/cp)
    return [context.shard_sequence(t, rank, size, dim=1) for t in tensors], positions


def loss_context(tp):
    """Tensor parallel's loss-parallel context when `tp` > 1 (its module read only then), else a no-op."""
    return dimension_module("tp").tp_loss_context(True) if tp > 1 else nullcontext()


def autocast(plan):
    """The plan's autocast (bf16/fp16 runs), or none (fp32)."""
    if plan.model.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(plan.layout.device).type, dtype=plan.model.dtype)

