"""Decoding's linears on weights packed once per rollout (CPU): each step of a decode multiplies a few rows by every
weight of the model, where MKL's sgemm runs at ~30 GFLOP/s; oneDNN's on a weight reordered once for that batch runs
1.7-2.5x faster (model/torch_compat.py packed_cpu_linear_weight), and one rollout's ~30 steps repay the reorder
(~0.1-0.3 ms a weight) many times over. Inside `packed_linears` every plain CPU nn.Linear of the model whose weight
is large enough to gain (PACK_MIN_ELEMENTS) runs on its packed weight in the dtype F.linear would compute in
(autocast's, else the weight's); the same products up to fp32 rounding (another kernel's summation order). While it
lasts it holds a packed copy of those weights (fp32: once more; bf16: what autocast's cache of cast weights would
hold). Nothing changes on a GPU, for a sharded (DTensor) weight, or without oneDNN."""
from contextlib import contextmanager

import torch
from torch import nn

from model.model_minimind import autocast_dtype
from model.torch_compat import packed_cpu_linear, packed_cpu_linear_weight

# the smallest weight packed, by compute dtype (sample's decode, 8 rows x 32 tokens, 4 layers, 1 thread, AMD EPYC,
# medians of 10 interleaved runs): in fp32 a 256 x 256 weight multiplies 8 rows as fast either way, a 128 x 256 one
# slower packed, and a reorder costs ~0.1-0.3 ms, so only weights from 512 x 256 on (the MLP's, the lm_head) are
# packed: hidden 256 209 ms unpacked, 174 all packed, 162 these; hidden 64 88, 119, 92. In bf16 every packed weight
# pays: hidden 256 234, 165 all, 186 the large ones; hidden 64 131, 120, 125.
PACK_MIN_ELEMENTS = {torch.float32: 1 << 17, torch.bfloat16: 0}


def _packable(module):
    if type(module) is not nn.Linear or "forward" in module.__dict__:  # a forward patched by someone else: kept
        return False
    weight = module.weight
    if type(weight) is not nn.Parameter or weight.device.type != "cpu":
        return False
    dtype = autocast_dtype(weight)
    return dtype in PACK_MIN_ELEMENTS and weight.numel() >= PACK_MIN_ELEMENTS[dtype]


class PackedForward:
    """A Linear's forward on its weight packed for `rows`: x cast to the packed dtype, as autocast would cast it."""

    def __init__(self, packed, bias, dtype):
        self.packed, self.bias, self.dtype = packed, bias, dtype

    def __call__(self, x):
        return packed_cpu_linear(x.to(self.dtype), self.packed, self.bias)


@contextmanager
def packed_linears(model, rows):
    """Within it, the model's plain CPU Linears whose weights have PACK_MIN_ELEMENTS or more (LoRA's hooks kept)
    multiply by weights packed for batches of `rows`, read once on entry: for inference on unchanging weights only (a
    decode loop); yields how many were packed."""
    patched = []
    for module in [m for m in model.modules() if _packable(m)]:
        dtype = autocast_dtype(module.weight)
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
