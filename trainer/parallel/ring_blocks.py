"""One q block of the ring against one k/v block: (out, lse) forward and (dq, dk, dv) backward.

Unmasked blocks run torch's own fused attention ops (CPU flash; CUDA flash for bf16/fp16, memory-efficient
otherwise: model/torch_compat.py), the backward from the *global* out and lse as torch's context parallel does; a
kernel that raises for a dtype or head dim falls back to the math below once and for all. Blocks with a document
mask run math in the compute dtype (fp32 at least). Used by trainer/parallel/context.py.
"""
import torch

from model.torch_compat import fused_attention_kernels as fused_kernels  # torch's private aten ops

FAILED_KERNELS = set()  # (kernel, direction, device type, dtype, head dim) that raised once: don't retry every block


def _run_fused(direction, q, *args):
    """The first fused kernel for q that runs (direction 1: forward, 2: backward), or None: the math kernel."""
    for kernel in fused_kernels(q):
        key = (kernel[0], direction, q.device.type, q.dtype, q.shape[-1])
        if key in FAILED_KERNELS:
            continue
        try:
            return kernel[direction](*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):
            FAILED_KERNELS.add(key)  # unsupported dtype / head dim / build: use the next kernel
    return None


def _scores(q, k, causal, scale, visible=None):
    """q k^T * scale in the compute dtype, with the (top-left aligned) causal mask or a (B, 1, Lq, Lk) `visible`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if visible is not None:
        return scores.masked_fill(~visible, float("-inf"))
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def finite_lse(lse):
    """lse with -inf (a row that sees nothing in a block) as 0, so exp(x - lse) gives 0 instead of NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(q, k, v, causal, scale, visible=None):
    """Attention of a q block over one (GQA-expanded) k/v block -> (out, lse) in the compute dtype.

    Unmasked blocks: torch's fused kernel in the inputs' dtype. visible: a document mask for this block
    (math in the compute dtype; a row that sees nothing gets lse -inf, out 0)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    if visible is None:
        result = _run_fused(1, q, q, k, v, causal, scale)
        if result is not None:
            return result[0].to(compute), result[1].to(compute)
    scores = _scores(q.to(compute), k.to(compute), causal, scale, visible)
    lse = scores.logsumexp(-1)
    return torch.matmul(torch.exp(scores - finite_lse(lse).unsqueeze(-1)), v.to(compute)), lse


def block_backward(dout, q, k, v, out, lse, causal, scale, visible=None):
    """Gradients (in lse's compute dtype) of one block from the global out and lse.

    Because P is rebuilt from the global lse, the blocks' gradients add up to the full-attention gradient.
    Each block's backward runs in its forward's precision: the fused kernel where the forward used one,
    else math (dS = P * (dP - rowsum(dO * O))) in the compute dtype.
    """
    compute = lse.dtype
    if visible is None:
        grads = _run_fused(2, q, *(t.contiguous() for t in (dout, q, k, v, out, lse)), causal, scale)
        if grads is not None:
            return tuple(grad.to(compute) for grad in grads)
    dout, q, k, v = (t.to(compute) for t in (dout, q, k, v))
    delta = (dout * out.to(compute)).sum(-1)
    probs = torch.exp(_scores(q, k, causal, scale, visible) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
    return dq, dk, dv


def expand_kv(kv, n_rep):
    """(B, Hkv, L, D) -> (B, Hkv*n_rep, L, D), kv head j serving q heads j*n_rep .. (j+1)*n_rep-1."""
    return kv if n_rep == 1 else kv.repeat_interleave(n_rep, dim=1)


def reduce_kv_grad(grad, n_rep):
    """Sum the gradients of the q heads that share one kv head (inverse of expand_kv)."""
    return grad if n_rep == 1 else grad.unflatten(1, (-1, n_rep)).sum(2)
