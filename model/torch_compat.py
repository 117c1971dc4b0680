"""Every private torch API this repository calls, in one place: what it is for, the torch versions it was checked on,
and what happens where it is missing (a fallback, or one line saying what to change).

Here in model/ because both model/ and trainer/ use it and model/ may not import trainer/. Two entries are only listed:
model_minimind.py looks the CPU flash kernel up itself (CPU_FLASH_OP) and moe.py the grouped matmul (GROUPED_MM_OPS),
because convert_model copies those files (model_minimind.py and what it imports relatively) into an exported folder as
its trust_remote_code modules, where no other module of this repository exists.

Checked on torch 2.13.0 (installed here; the suite runs every entry that runs on CPU) and torch 2.11.0 (the GPU box:
its wheel's native_functions.yaml, Python sources and libtorch_cpu.so read for each name and signature below).
"""
from datetime import timedelta

import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh

CHECKED_ON = ("2.11.0", "2.13.0")
# model_minimind.py's own getattr(torch.ops.aten, CPU_FLASH_OP, None): the CPU flash kernel with an attn_mask (SDPA
# takes no mask on it); None: SDPA with the dense mask (same values, slower on long packed rows)
CPU_FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
# moe.grouped_mm_op's own lookup, first found wins: torch.nn.functional.grouped_mm (public from 2.10),
# torch._grouped_mm (2.8+; CUDA bf16 on sm80+ by its docstring, CPU fp32/bf16 run in 2.13). expert_compute_for
# probes the device and dtype once; missing or refused: the experts run in a loop with one host sync per MoE layer
GROUPED_MM_OPS = (("torch.nn.functional", "grouped_mm"), ("torch", "_grouped_mm"))


def set_default_pg_timeout(seconds):
    """distributed_c10d._set_pg_timeout(timedelta, None): the default group's collective timeout after start-up
    (torchtitan's train_timeout_seconds). Missing: the start-up timeout stays in force."""
    if hasattr(distributed_c10d, "_set_pg_timeout"):
        distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), None)


def flatten_mesh(mesh, name):
    """DeviceMesh._flatten(name) of a sub-mesh (torchtitan's dp x cp mesh); None where torch lacks it, and the caller
    builds the groups with dist.new_group (parallel/mesh.py)."""
    return mesh._flatten(name) if hasattr(DeviceMesh, "_flatten") else None


def cpu_bf16_native():
    """torch.ops.mkldnn._is_mkldnn_bf16_supported(): this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX).
    Missing: False, so the trainer picks fp32 on CPU and refuses bf16 there in one line."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def foreach_mul_(tensors, scalar):
    """torch._foreach_mul_(tensors, scalar tensor) in place (one kernel per device); missing: a loop of mul_, which
    gives the same products."""
    if hasattr(torch, "_foreach_mul_"):
        torch._foreach_mul_(tensors, scalar)
    else:
        for tensor in tensors:
            tensor.mul_(scalar)


_PACKED_KERNELS = {}  # dtype -> whether oneDNN multiplies by a packed weight of that dtype here (tried once)


def packed_cpu_linear_weight(weight, rows):
    """torch.ops.mkldnn._reorder_linear_weight(weight, rows): a Linear's (out, in) weight in oneDNN's blocked layout
    for batches of `rows`, for packed_cpu_linear (as torch.compile's CPU backend packs frozen weights). Decoding's 8
    rows (hidden 256, 1 thread, AMD EPYC): 1.7-2.5x MKL's sgemm on the plain weight. None where this torch or CPU has
    no oneDNN or no kernel for the dtype (a small product tried once per dtype): the caller keeps F.linear."""
    try:
        if weight.dtype not in _PACKED_KERNELS:
            _PACKED_KERNELS[weight.dtype] = False  # until the trial has run
            trial = torch.ones(8, 8, dtype=weight.dtype)
            packed_cpu_linear(trial, torch.ops.mkldnn._reorder_linear_weight(trial, 8))
            _PACKED_KERNELS[weight.dtype] = True
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows) if _PACKED_KERNELS[weight.dtype] else None
    except (AttributeError, RuntimeError):
        return None


def packed_cpu_linear(x, packed, bias=None):
    """torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): x @ weight.T + bias for a weight packed by
    packed_cpu_linear_weight, x and bias in its dtype; any number of leading dimensions and rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def scaler_found_inf_per_device(scaler, optimizer):
    """GradScaler._found_inf_per_device(optimizer): the fp16 scaler's found-inf tensors after unscale_ (the step
    guard agrees on them over every rank). Missing: one line asking for bf16 or a checked torch."""
    if not hasattr(scaler, "_found_inf_per_device"):
        raise RuntimeError(f"this torch ({torch.__version__}) has no GradScaler._found_inf_per_device, which fp16 "
                           f"training reads; train in bf16 or fp32, or use torch {' / '.join(CHECKED_ON)}")
    return scaler._found_inf_per_device(optimizer)


def flatten_optim_state_dict(optimizer_state):
    """DCP's _flatten_optim_state_dict: {"state": {fqn: {key: v}}, "param_groups": [...]} -> {"state.<fqn>.<key>": v,
    "param_groups.<fqn>.<key>": v} (the ZeRO-1 optimizer's state in the per-FQN layout every other one saves).
    Missing: one line asking for another ZeRO stage or a checked torch."""
    flatten = getattr(dcp_state_dict, "_flatten_optim_state_dict", None)
    if flatten is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no _flatten_optim_state_dict, which saving a ZeRO-1 "
                           f"optimizer needs; use another ZeRO stage, or torch {' / '.join(CHECKED_ON)}")
    return flatten(optimizer_state)


# ------------------------------------------------------------------------------------------------------------
# Attention kernels of one ring block (trainer/parallel/ring_blocks.py): each returns (out, lse) forward and
# (dq, dk, dv) backward from the *global* out and lse, as torch's context parallel calls them. A kernel whose op is
# missing is not offered; one that raises for a dtype or head dim is skipped: the ring's math kernel runs instead.
# ------------------------------------------------------------------------------------------------------------
def _aten_has(*names):
    return all(hasattr(torch.ops.aten, name) for name in names)


def _cpu_flash_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _cuda_flash_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    """cum_seq None: the dense kernel (a defined one means varlen); dropout 0 reads no philox state, so empty tensors
    stand for the forward's."""
    rng = torch.empty(0, dtype=torch.long, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, rng, rng, scale=scale)


def _cuda_efficient_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, lse[..., :q.shape[-2]]  # its lse is padded to a multiple of 32 rows


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    """The lse padded back to the forward's multiple of 32 rows; dropout 0: the philox tensors are not read."""
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))
    rng = torch.empty(0, dtype=torch.long, device=q.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, rng, rng, 0.0, [True, True, True, False], causal, scale=scale)[:3]


def fused_attention_kernels(q):
    """Candidate fused (name, forward, backward) kernels for q's device and dtype, best first."""
    if q.device.type == "cpu" and _aten_has("_scaled_dot_product_flash_attention_for_cpu",
                                            "_scaled_dot_product_flash_attention_for_cpu_backward"):
        yield "flash_cpu", _cpu_flash_forward, _cpu_flash_backward
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and _aten_has("_scaled_dot_product_flash_attention",
                                                                    "_scaled_dot_product_flash_attention_backward"):
            yield "flash_cuda", _cuda_flash_forward, _cuda_flash_backward
        if _aten_has("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"):
            yield "efficient_cuda", _cuda_efficient_forward, _cuda_efficient_backward
