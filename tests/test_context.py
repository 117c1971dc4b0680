"""Context parallelism: ring attention and a cp-sharded model against the single-process result."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.model_minimind import packed_document_mask
from tests.helpers.launch import spawn
from trainer.parallel import context, ring_blocks
from trainer.parallel.context import apply_context_parallel, context_position_ids, ring_attention, shard_sequence


def unshard_sequence(shards, dim=1):
    """Inverse of shard_sequence: the full sequence from all ranks' shards, given in cp rank order."""
    heads, tails = zip(*(shard.chunk(2, dim) for shard in shards))
    return torch.cat(list(heads) + list(reversed(tails)), dim)


def _full_attention(q, k, v, dout, positions=None):
    """Reference: causal SDPA on the full sequence (GQA expanded) -> out, (dq, dk, dv); with packed `positions`,
    the model's block-diagonal document mask instead of is_causal."""
    n_rep = q.shape[1] // k.shape[1]
    mask = None if positions is None else packed_document_mask(positions)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                         attn_mask=mask, is_causal=mask is None)
    return out, torch.autograd.grad(out, (q, k, v), dout)


def _packed_positions(batch, length):
    """Position ids of packed rows: documents of lengths 5, 9, 11, 3, ... restarting at 0 (offset per row)."""
    rows = []
    for row in range(batch):
        positions = []
        for doc_length in [5 + 4 * row, 9, 11, 3, 7, length]:
            positions += list(range(doc_length))
        rows.append(torch.tensor(positions[:length]))
    return torch.stack(rows)


def _check_ring(rank, cp_size, group, num_heads, num_kv_heads, dtype, tol, packed=False):
    generator = torch.Generator().manual_seed(1234)  # same full tensors on every rank
    B, L, D = 2, 32, 16
    q, k, v = (torch.randn(B, h, L, D, generator=generator, dtype=dtype, requires_grad=True)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    dout = torch.randn(B, num_heads, L, D, generator=generator, dtype=dtype)
    positions = _packed_positions(B, L) if packed else None
    ref_out, ref_grads = _full_attention(q, k, v, dout, positions)

    local = [shard_sequence(t.detach(), rank, cp_size, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, None if positions is None else shard_sequence(positions, rank, cp_size))
    out.backward(shard_sequence(dout, rank, cp_size, dim=2))
    def shard(t):
        return shard_sequence(t, rank, cp_size, dim=2)
    torch.testing.assert_close(out, shard(ref_out), atol=tol, rtol=tol)
    for name, tensor, ref_grad in zip("qkv", local, ref_grads):
        torch.testing.assert_close(tensor.grad, shard(ref_grad), atol=tol, rtol=tol, msg=f"d{name} differs")


def _ring_worker(rank, world_size):
    for num_heads, num_kv_heads in [(4, 2), (4, 4)]:
        _check_ring(rank, world_size, dist.group.WORLD, num_heads, num_kv_heads, torch.float32, 1e-5)
    _check_ring(rank, world_size, dist.group.WORLD, 4, 2, torch.float64, 1e-10)
    _check_ring(rank, world_size, dist.group.WORLD, 4, 2, torch.float32, 1e-5, packed=True)  # --doc_mask
    _check_ring(rank, world_size, dist.group.WORLD, 4, 2, torch.float64, 1e-10, packed=True)
    if world_size == 2:  # again with the math per-block kernel (this process only)
        ring_blocks.fused_kernels = lambda q: iter(())
        _check_ring(rank, world_size, dist.group.WORLD, 4, 2, torch.float32, 1e-5)
    if world_size == 4:  # cp=2 groups inside a 4-process world (cp x dp): ring peers map to global ranks
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
        group = groups[rank % 2]
        _check_ring(dist.get_rank(group), 2, group, 4, 2, torch.float32, 1e-5)


BF16_UNIT = 2.0 ** -8  # bf16 unit roundoff (8 significand bits)


def _bf16_magnitudes(q, k, v, dout, positions=None):
    """Per-element |a||b| sums behind out, dq, dk, dv (float64 of the bf16 inputs): the scale of their bf16 error.

    Componentwise rounding analysis (|fl(AB) - AB| <= c u |A||B|): out = P V and dV = P^T dO see three roundings
    (P to bf16 in the kernel, the block's bf16 result, the final cast); dQ = dS K and dK = dS^T Q see six (dS
    from the bf16 out's error in rowsum(dO * O), dS to bf16, the block's result, the final cast), with
    |dS| <= P * (|dO| |V|^T + rowsum(|dO| * P|V|)). fp32 accumulation adds ~2^-24 relative: negligible.
    """
    n_rep, length, scale = q.shape[1] // k.shape[1], q.shape[2], q.shape[-1] ** -0.5
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril() if positions is None \
        else packed_document_mask(positions)
    probs = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
    out = probs @ v.abs()
    dscores = probs * (dout.abs() @ v.abs().transpose(-1, -2) + (dout.abs() * out).sum(-1, keepdim=True))
    def per_kv_head(grad):
        return grad.unflatten(1, (-1, n_rep)).sum(2)
    return (3 * out, 6 * scale * dscores @ k.abs(), per_kv_head(6 * scale * dscores.transpose(-1, -2) @ q.abs()),
            per_kv_head(3 * probs.transpose(-1, -2) @ dout.abs()))


def _assert_within_bf16(got, want, magnitude, what):
    error = (got.detach().double() - want).abs()
    worst = float((error / (BF16_UNIT * magnitude)).max())
    assert worst <= 1, f"{what}: error {float(error.max()):.3g} exceeds the bf16 bound by {worst:.2f}x"


def _ring_autocast_worker(rank, cp_size):
    """Under bf16 autocast (fp32 q/k/v, as the model's fp32 RMSNorm weight makes them) the ring runs in bf16."""
    generator = torch.Generator().manual_seed(7)
    B, L, D = 2, 32, 16
    q, k, v = (torch.randn(B, h, L, D, generator=generator) for h in (4, 2, 2))
    dout = torch.randn(B, 4, L, D, generator=generator)
    def shard(t):
        return shard_sequence(t, rank, cp_size, dim=2)
    for positions in (None, _packed_positions(B, L)):
        # reference: float64 attention of the bf16-rounded inputs (the rounding the cast at the boundary makes)
        full = [t.bfloat16().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_grads = _full_attention(*full, dout.bfloat16().double(), positions)
        magnitudes = _bf16_magnitudes(*(t.detach() for t in full), dout.bfloat16().double(), positions)
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ring_attention(*local, dist.group.WORLD, None if positions is None else shard_sequence(
                positions, rank, cp_size))
        assert out.dtype == torch.bfloat16
        out.backward(shard(dout).bfloat16())
        for got, want, magnitude, what in zip([out] + [t.grad for t in local], [ref_out] + list(ref_grads),
                                             magnitudes, ("out", "dq", "dk", "dv")):
            _assert_within_bf16(got, shard(want.detach()), shard(magnitude), what)


def test_ring_attention_under_bf16_autocast():
    spawn(_ring_autocast_worker, 2, timeout=120, start_method="fork")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.py runs it)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernels_rebuild_full_attention(device, dtype):
    """Two blocks as the ring runs them (tail queries over a full earlier block and a causal one), forward merged
    by log-sum-exp and each block's fused backward from the global out and lse: full attention's values."""
    generator = torch.Generator().manual_seed(3)
    B, H, L, D = 2, 4, 32, 16
    q, k, v, dout = (torch.randn(B, H, L, D, generator=generator).to(device, dtype) for _ in range(4))
    half, scale = L // 2, D ** -0.5
    dout[:, :, :half] = 0  # only the tail queries are in these blocks
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_grads = _full_attention(*full, dout.double())
    ring_blocks.FAILED_KERNELS.clear()
    queries, blocks = q[:, :, half:], [(k[:, :, :half], v[:, :, :half], False), (k[:, :, half:], v[:, :, half:], True)]
    results = [ring_blocks.block_forward(queries, *block, scale) for block in blocks]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(block_out * torch.exp(block_lse - lse).unsqueeze(-1) for block_out, block_lse in results).to(dtype)
    grads = [ring_blocks.block_backward(dout[:, :, half:], queries, *block[:2], out, lse, block[2], scale)
             for block in blocks]
    assert not ring_blocks.FAILED_KERNELS, f"a fused kernel failed, the math fallback ran: {ring_blocks.FAILED_KERNELS}"
    got = [out, grads[0][0] + grads[1][0], torch.cat([grads[0][1], grads[1][1]], 2),
           torch.cat([grads[0][2], grads[1][2]], 2)]
    want = [ref_out[:, :, half:]] + [g.detach() for g in ref_grads]
    want[1] = want[1][:, :, half:]
    if dtype == torch.float32:
        for got_tensor, want_tensor in zip(got, want):
            torch.testing.assert_close(got_tensor.double(), want_tensor, atol=1e-5, rtol=1e-5)
        return
    magnitudes = list(_bf16_magnitudes(*(t.detach() for t in full), dout.double()))
    magnitudes[0], magnitudes[1] = magnitudes[0][:, :, half:], magnitudes[1][:, :, half:]
    for got_tensor, want_tensor, magnitude, what in zip(got, want, magnitudes, ("out", "dq", "dk", "dv")):
        _assert_within_bf16(got_tensor, want_tensor, magnitude, what)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_attention_matches_full_causal_attention(cp_size):
    spawn(_ring_worker, cp_size, timeout=120, start_method="fork")


def test_single_process_math_fallback_matches_fused(monkeypatch):
    """Without a process group the ring is one local block; the math kernel must match the fused one."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=generator, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 4, 16, 8, generator=generator)
    ref_out, ref_grads = _full_attention(q, k, v, dout)
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ring_blocks, "fused_kernels", lambda q: iter(()))
        out = ring_attention(q, k, v, None)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for grad, ref_grad in zip(torch.autograd.grad(out, (q, k, v), dout), ref_grads):
            torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_shard_unshard_and_positions():
    assert context_position_ids(8, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert context_position_ids(8, 1, 2).tolist() == [[2, 3, 4, 5]]
    assert context_position_ids(16, 1, 4).tolist() == [[2, 3, 12, 13]]
    tokens = torch.arange(8).view(1, 8)
    assert shard_sequence(tokens, 0, 2).tolist() == [[0, 1, 6, 7]]
    full = torch.randn(2, 24, 3)
    for cp_size in (1, 2, 3):
        shards = [shard_sequence(full, r, cp_size) for r in range(cp_size)]
        assert torch.equal(unshard_sequence(shards), full)
    with pytest.raises(ValueError, match="divisible"):
        shard_sequence(torch.zeros(1, 10), 0, 4)


def test_padding_mask_rejected():
    attn_fn = context.make_ring_attn_fn(None)
    q = torch.randn(1, 2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match="padding"):
        attn_fn(q, q, q, mask)


def _tiny_model(use_moe):
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    torch.manual_seed(0)  # same weights on every rank and for the reference
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=128, use_moe=use_moe, num_experts=4, num_experts_per_tok=2)
    return MiniMindForCausalLM(config)


def _model_worker(rank, cp_size):
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 128, (2, 32), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a masked prompt, so num_items differs from the token count
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # shifted by the trainer, then sharded like the inputs
    num_items = (targets != -100).sum()
    def shard(t):
        return shard_sequence(t, rank, cp_size, dim=1)
    for use_moe, packed in ((False, False), (True, False), (False, True), (True, True)):
        positions = _packed_positions(2, 32) if packed else None  # --doc_mask: documents restart at 0
        model = _tiny_model(use_moe)
        ref = model(input_ids, position_ids=positions, shift_labels=targets, num_items_in_batch=num_items)
        (ref.loss + ref.aux_loss).backward()

        cp_model = apply_context_parallel(_tiny_model(use_moe), dist.group.WORLD, doc_mask=packed)
        local_positions = shard(positions) if packed else context_position_ids(32, rank, cp_size)
        out = cp_model(shard(input_ids), position_ids=local_positions,
                       shift_labels=shard(targets), num_items_in_batch=num_items)
        # the aux loss is replicated on every cp rank: each rank takes a 1/cp share of it
        (out.loss + out.aux_loss / cp_size).backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits, shard(ref.logits), atol=1e-5, rtol=1e-5)
        if use_moe:
            assert ref.aux_loss > 0
        ref_params = dict(model.named_parameters())
        for name, param in cp_model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_model_with_context_parallel_matches_single_process():
    spawn(_model_worker, 2, timeout=120, start_method="fork")
