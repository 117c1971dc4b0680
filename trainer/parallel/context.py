"""Context parallelism: causal ring attention over a cp process group, applied from outside the model.

The sequence is cut into 2*cp chunks; cp rank r holds chunk r and chunk 2*cp-1-r (head + tail), so every
rank does the same amount of causal attention work. K/V blocks travel around the ring with point-to-point
send/recv and the partial outputs are merged by log-sum-exp. Packed rows (--doc_mask) are masked per
block: a query at global index i whose document starts at s sees keys j with s <= j <= i, where
s = i - (its position id), so no document ids need to travel. torch's experimental
`torch.distributed.tensor.experimental.context_parallel` does not run on CPU (gloo), hence this own
version (docs/design.md, "Context parallel"); the per-block kernels are torch's own fused attention ops.
"""
import functools
import warnings

import torch
import torch.distributed as dist

from trainer.parallel.ring_blocks import block_backward, block_forward, expand_kv, finite_lse, reduce_kv_grad

# the autograd-aware all_reduce is deprecated in favour of a functional collective that has no autograd for it
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated",
                        category=FutureWarning)


# ----------------------------------------------------------------------------- sequence sharding
def validate(args, config, zero_stage):
    """The dimension's check (parallel/mesh.py DIMENSIONS): one line saying what to change, else None."""
    if args.max_seq_len % (2 * args.cp):
        return (f"--max_seq_len {args.max_seq_len} must be divisible by 2*cp = {2 * args.cp} "
                "(each rank holds a head and a tail chunk); change --max_seq_len or --cp")
    return None


def shard_sequence(tensor, cp_rank, cp_size, dim=1):
    """Return this cp rank's part of `tensor` along `dim`: chunk cp_rank and chunk 2*cp_size-1-cp_rank."""
    if cp_size == 1:
        return tensor
    if tensor.shape[dim] % (2 * cp_size):
        raise ValueError(f"sequence length {tensor.shape[dim]} must be divisible by 2*cp = {2 * cp_size}")
    chunks = tensor.chunk(2 * cp_size, dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim)


def context_position_ids(seq_len, cp_rank, cp_size, device=None):
    """Global positions (for RoPE) of this cp rank's tokens, shape (1, seq_len // cp_size) like the model's default."""
    return shard_sequence(torch.arange(seq_len, device=device).unsqueeze(0), cp_rank, cp_size, dim=1)


# ----------------------------------------------------------------------------- ring
def _rank_size(group):
    if not dist.is_initialized():
        return 0, 1  # single process: the ring is just the local block
    return dist.get_rank(group), dist.get_world_size(group)


def _ring_exchange(send, recv, group, tag):
    """Post send -> next rank and recv <- previous rank; return the requests to wait on.

    Hand-written ring send/recv: torch has no ring-attention collective that runs on gloo and nccl.
    """
    rank, size = _rank_size(group)
    group = group or dist.group.WORLD
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, send, next_rank, group, tag), dist.P2POp(dist.irecv, recv, prev_rank, group, tag)]
    return dist.batch_isend_irecv(ops)


def _block_plan(src, rank, half):
    """(q rows, kv columns, causal) that rank's (head, tail) chunks attend to in src's (head, tail) chunks."""
    everything, head, tail = slice(None), slice(0, half), slice(half, None)
    if src == rank:
        return everything, everything, True  # both local chunks, ascending global order: plain causal
    if src < rank:
        return everything, head, False  # src's head precedes both of ours; src's tail follows both
    return tail, everything, False  # only our tail comes after src's chunks, and after both of them


def _block_visible(doc_starts, src, rank, size, rows, cols, device):
    """(B, 1, rows, cols) mask of which of src's keys each of our queries sees, or None without documents.

    doc_starts: (B or 1, L_local) global index of each local query's document start."""
    if doc_starts is None:
        return None
    length = doc_starts.shape[-1] * size
    q_index = context_position_ids(length, rank, size, device)[0, rows]
    k_index = context_position_ids(length, src, size, device)[0, cols]
    starts = doc_starts[:, rows]
    keys = k_index[None, None, :]
    return ((keys <= q_index[None, :, None]) & (keys >= starts[:, :, None]))[:, None]


class RingAttention(torch.autograd.Function):
    """Causal GQA attention over a sequence sharded head+tail across the cp group (doc_starts: per document)."""

    @staticmethod
    def forward(ctx, q, k, v, group, doc_starts=None):
        rank, size = _rank_size(group)
        scale, n_rep, half = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1], q.shape[2] // 2
        compute = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=compute, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=compute, device=q.device)
        kv = torch.stack([k, v])  # one message per step; un-repeated heads travel, expanded per block
        for step in range(size):
            if step < size - 1:
                next_kv = torch.empty_like(kv)
                requests = _ring_exchange(kv, next_kv, group, tag=0)  # overlaps with this block's compute
            src = (rank - step) % size
            rows, cols, causal = _block_plan(src, rank, half)
            visible = _block_visible(doc_starts, src, rank, size, rows, cols, q.device)
            block_out, block_lse = block_forward(q[:, :, rows], expand_kv(kv[0][:, :, cols], n_rep),
                                                  expand_kv(kv[1][:, :, cols], n_rep), causal, scale, visible)
            old_lse = lse[:, :, rows]
            new_lse = torch.logaddexp(old_lse, block_lse)  # log-sum-exp merge of partial softmaxes
            safe_lse = finite_lse(new_lse)  # rows that have seen nothing yet stay 0
            out[:, :, rows] = (out[:, :, rows] * torch.exp(old_lse - safe_lse).unsqueeze(-1)
                               + block_out * torch.exp(block_lse - safe_lse).unsqueeze(-1))
            lse[:, :, rows] = new_lse
            if step < size - 1:
                for request in requests:
                    request.wait()
                kv = next_kv
        out = out.to(q.dtype)  # what the fused backward kernels take, as torch's context parallel saves it
        ctx.group, ctx.doc_starts = group, doc_starts
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, doc_starts = ctx.group, ctx.doc_starts
        rank, size = _rank_size(group)
        scale, n_rep, half = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1], q.shape[2] // 2
        compute = lse.dtype  # gradients accumulate (and dK/dV travel) in fp32 or better
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=compute, device=kv.device)  # dK/dV of the block we hold
        for step in range(size):
            requests = []
            if step < size - 1:
                next_kv = torch.empty_like(kv)
                requests += _ring_exchange(kv, next_kv, group, tag=0)
            src = (rank - step) % size
            rows, cols, causal = _block_plan(src, rank, half)
            dq_block, dk_block, dv_block = block_backward(
                dout[:, :, rows], q[:, :, rows], expand_kv(kv[0][:, :, cols], n_rep),
                expand_kv(kv[1][:, :, cols], n_rep), out[:, :, rows], lse[:, :, rows],
                causal, scale, _block_visible(doc_starts, src, rank, size, rows, cols, q.device))
            dq[:, :, rows] += dq_block
            dkv[0][:, :, cols] += reduce_kv_grad(dk_block, n_rep)
            dkv[1][:, :, cols] += reduce_kv_grad(dv_block, n_rep)
            if size > 1:
                # dK/dV travel with their block; after the last step each rank receives its own
                next_dkv = torch.empty_like(dkv)
                requests += _ring_exchange(dkv, next_dkv, group, tag=1)
            for request in requests:
                request.wait()
            if size > 1:
                kv, dkv = (next_kv if step < size - 1 else kv), next_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, cp_group, position_ids=None):
    """Causal ring attention. q (B, Hq, L_local, D), k/v (B, Hkv, L_local, D), sharded by shard_sequence.

    position_ids: (B or 1, L_local) this rank's positions, restarting per document (packed rows, sharded
    with shard_sequence): each token attends within its document only (masked blocks, math kernel).
    None: plain causal (fused kernels). The caller decides from the plan (--doc_mask), never from the values."""
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"ring attention needs equal, even local q/k lengths, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    doc_starts = None
    if position_ids is not None:
        rank, size = _rank_size(cp_group)
        index = context_position_ids(q.shape[2] * size, rank, size, q.device)
        doc_starts = index - position_ids.to(q.device)  # global index of each query's document start
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):  # q/k arrive fp32 (fp32 norm weight): kernels and K/V in autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device_type, enabled=False):  # the blocks choose their own dtypes (fp32 math and merge)
        return RingAttention.apply(q, k, v, cp_group, doc_starts)


class LocalPositions:
    """What the model's `document_mask` hook returns under cp: this rank's position ids, for the ring to mask by."""

    def __init__(self, position_ids):
        self.position_ids = position_ids


def no_document_mask(position_ids):
    """document_mask without --doc_mask: rows hold one sequence each, so no mask (the causal kernel; under cp the
    positions are global, RoPE only, and the ring is plain causal). Pipeline stages take it too."""
    return None


def make_ring_attn_fn(cp_group):
    """An `attn_fn(q, k, v, attention_mask=None)` for the model's Attention modules, using ring attention."""
    def ring_attn_fn(q, k, v, attention_mask=None):
        if isinstance(attention_mask, LocalPositions):
            return ring_attention(q, k, v, cp_group, attention_mask.position_ids)
        if attention_mask is not None:  # the model drops an all-ones mask itself: this one pads
            raise ValueError("context parallel supports causal attention without padding masks; "
                             "train with attention_mask=None (packed or fully padded-with-labels batches)")
        return ring_attention(q, k, v, cp_group)
    return ring_attn_fn


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group whose backward sums the gradients over it too (torch's autograd all_reduce in
    torch.distributed.nn is deprecated; its replacement is private)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _all_reduce_sum(tensor, group):
    """Autograd-aware sum over the cp group (its backward all-reduces the gradients too)."""
    return _AllReduceSum.apply(tensor, group)


def apply_context_parallel(model, cp_mesh, doc_mask=True):
    """Swap in ring attention (with the positions for document masks) and cp-wide MoE router statistics, in place.

    cp_mesh: a 1-D DeviceMesh (e.g. mesh["cp"]) or a ProcessGroup. Inputs, targets and position_ids
    must be sharded with shard_sequence / context_position_ids. doc_mask (the plan's): position ids restart
    per document, so the ring masks by them; False: plain causal with the fused kernels (no host sync decides).
    The router-stat all-reduce's backward sums gradients over the group, so each cp rank's objective should
    weight the (replicated) MoE aux loss by 1/cp for the ranks' summed gradients to equal the single-process ones.
    """
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    cp_size = _rank_size(group)[1]
    attn_fn = make_ring_attn_fn(group)
    reduce_fn = functools.partial(_all_reduce_sum, group=group)
    num_attention = 0
    for module in model.modules():
        if hasattr(module, "attn_fn"):
            module.attn_fn = attn_fn
            num_attention += 1
        if hasattr(module, "document_mask"):  # the model / a pipeline stage: the ring masks by positions
            module.document_mask = LocalPositions if doc_mask else no_document_mask
        if hasattr(module, "reduce_router_stats"):
            module.reduce_router_stats = reduce_fn
            module.seq_len_scale = cp_size  # local token counts are normalised by the full length
    if num_attention == 0:
        raise ValueError("apply_context_parallel found no module with an `attn_fn` attribute to replace")
    return model
