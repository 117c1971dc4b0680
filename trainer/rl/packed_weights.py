"""Decoding's linears on weights packed once per rollout (CPU): each step of a decode multiplies a few rows by every
weight of the model, where MKL's sgemm runs at ~30 GFLOP/s; oneDNN's on a weight reordered once for that batch runs
1.7-2.5x faster (model/torch_compat.py packed_cpu_linear_weight), and one rollout's ~30 steps repay the reorder
(~0.1 ms a weight) many times over. Inside `packed_linears` every plain CPU nn.Linear of the model runs on its packed
weight in the dtype F.linear would compute in (autocast's, else the weight's); the same products up to fp32 rounding
(another kernel's summation order). While it lasts it holds a packed copy of each weight (fp32: the weights once more;
bf16: what autocast's cache of cast weights would hold). Nothing changes on a GPU, for a sharded (DTensor) weight, or
without oneDNN."""
from contextlib import contextmanager

import torch
from torch import nn

from model.torch_compat import packed_cpu_linear, packed_cpu_linear_weight

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _compute_dtype(weight):
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype


def _packable(module):
    if type(module) is not nn.Linear or "forward" in module.__dict__:  # a forward patched by someone else: kept
        return False
    weight = module.weight
    return type(weight) is nn.Parameter and weight.device.type == "cpu" and _compute_dtype(weight) in PACKED_DTYPES


class PackedForward:
    """A Linear's forward on its weight packed for `rows`: x cast to the packed dtype, as autocast would cast it."""

    def __init__(self, packed, bias, dtype):
        self.packed, self.bias, self.dtype = packed, bias, dtype

    def __call__(self, x):
        return packed_cpu_linear(x.to(self.dtype), self.packed, self.bias)


@contextmanager
def packed_linears(model, rows):
    """Within it, the model's plain CPU Linears (LoRA adapters and hooks included) multiply by weights packed for
    batches of `rows`, read once on entry: for inference on unchanging weights only (a decode loop)."""
    patched = []
    for module in [m for m in model.modules() if _packable(m)]:
        dtype = _compute_dtype(module.weight)
        with torch.no_grad():
            packed = packed_cpu_linear_weight(module.weight.detach().to(dtype), rows)
        if packed is None:  # no oneDNN here, or no kernel for the dtype
            break
        bias = None if module.bias is None else module.bias.detach().to(dtype)
        module.forward = PackedForward(packed, bias, dtype)
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
