"""Document-masked attention kernels, host syncs per step, and recompiles of compiled blocks."""
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from model.model_minimind import (
    CPU_FP32_ROWS,
    MiniMindConfig,
    MiniMindForCausalLM,
    causal_masked_cpu_attention,
    document_block_mask,
    packed_document_mask,
    sdpa_attention,
)
from model.moe import expert_compute_for

POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                          [5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7]])


def qkv(dtype, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8))  # GQA: 4 query heads over 2 kv heads
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


def dense_reference(q, k, v, mask):
    """SDPA with the dense boolean mask and the kv heads repeated by hand."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_cpu_causal_kernel_with_document_mask_matches_dense_sdpa(dtype, tol):
    """Outputs and gradients of the is_causal + mask kernel equal SDPA with the dense mask (same kernel family,
    fp32: blocks summed in another order, ~1e-7 of values ~1)."""
    mask = packed_document_mask(POSITIONS)
    q, k, v = qkv(dtype, requires_grad=True)
    ref = dense_reference(q, k, v, mask)
    assert (sdpa_attention(q, k, v, mask) - ref).abs().max().item() < tol
    out = causal_masked_cpu_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)
    assert (out - ref).abs().max().item() < tol
    weight = torch.randn(out.shape, dtype=dtype)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 10 * tol


def test_cpu_causal_kernel_under_autocast_matches_sdpa():
    """bf16 autocast: the kernel gets q/k/v in bf16, as autocast hands them to SDPA; same bf16 result."""
    mask = packed_document_mask(POSITIONS)
    q, k, v = qkv(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = dense_reference(q, k, v.bfloat16(), mask)
        out = causal_masked_cpu_attention(q, k.repeat_interleave(2, dim=1), v.bfloat16().repeat_interleave(2, dim=1),
                                          mask)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() < 2 ** -7  # one bf16 ulp at values ~1


@pytest.mark.parametrize("mask", ["document", "causal"])
def test_short_rows_under_bf16_autocast_run_in_fp32(mask):
    """CPU bf16 autocast, rows under CPU_FP32_ROWS: the output is the exact attention of the fp32 inputs (a float64
    computation here) rounded once to bf16 (half an ulp: 2^-8 relative at most, plus fp32's sums), and the input
    gradients are fp32's (a few 1e-7 of values ~1); autocast's bf16 kernel rounds q, k, v and the probabilities
    first."""
    mask = packed_document_mask(POSITIONS) if mask == "document" else None
    q, k, v = qkv(torch.float32, requires_grad=True)
    grad = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_attention(q, k, v, mask)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    keys, values = k64.repeat_interleave(2, dim=1), v64.repeat_interleave(2, dim=1)
    allowed = torch.ones(16, 16, dtype=torch.bool).tril() if mask is None else mask
    scores = (q64 @ keys.transpose(-2, -1) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ values
    ref.backward(grad.double())
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    for mine, exact in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert mine.dtype == torch.float32 and (mine.double() - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize("padded", [False, True])
def test_one_new_token_under_bf16_autocast_is_the_fp32_attention_rounded_once(padded):
    """Decoding on CPU under bf16 autocast (one query per row over a KV cache's strided keys, GQA, left padding
    masked): the exact attention of the bf16 cache (a float64 computation here) rounded once to bf16, half an ulp
    (2^-8 relative at most) plus fp32's sums; torch's bf16 kernel would round the probabilities first."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 1, 8, generator=g).bfloat16()
    cache = torch.randn(2, 3, 2, 24, 8, generator=g).bfloat16()  # a preallocated cache: 19 of 24 slots written
    k, v = cache[0, :, :, :19], cache[1, :, :, :19]
    lengths = torch.tensor([19, 11, 4])
    attention_mask = (torch.arange(19)[None] >= 19 - lengths[:, None]).long() if padded else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_attention(q, k, v, attention_mask)
    keys, values = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
    scores = q.double() @ keys.transpose(-2, -1) / 8 ** 0.5
    if padded:
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ values
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 1, 8)
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    # fp32 keeps SDPA's own kernel on one query (the faster there), within fp32 rounding of the same values
    out32 = sdpa_attention(q.float(), k.float(), v.float(), attention_mask)
    assert out32.dtype == torch.float32 and (out32.double() - ref).abs().max().item() < 1e-6


def test_rows_of_the_fp32_bound_keep_autocasts_bf16_kernel():
    """From CPU_FP32_ROWS positions on, bf16 autocast's own kernel runs (it is the faster there): the same values
    as SDPA under autocast, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, CPU_FP32_ROWS, 8, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = sdpa_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_flex_block_mask_matches_dense_mask(dtype, tol):
    """The CUDA path's BlockMask (run here by eager flex_attention, forward only on CPU) is the dense mask."""
    q, k, v = qkv(dtype)
    out = sdpa_attention(q, k, v, document_block_mask(POSITIONS))
    assert (out - dense_reference(q, k, v, packed_document_mask(POSITIONS))).abs().max().item() < tol


BRANCHES = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 3, 4, 0, 1, 2, 3],
                         [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]])  # prompts run once, answers branching off


def test_flex_block_mask_of_branched_rows_matches_dense_mask():
    """Branches (position ids stepping back to p > 0) in the BlockMask as in the dense mask: its mask_mod and
    packed_document_mask read the same prefix tree."""
    q, k, v = qkv(torch.float64)
    out = sdpa_attention(q, k, v, document_block_mask(BRANCHES))
    assert (out - dense_reference(q, k, v, packed_document_mask(BRANCHES))).abs().max().item() < 1e-12


def tiny_model(**kw):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=512, **kw)
    return MiniMindForCausalLM(config)


def count_syncs(monkeypatch, fn):
    """Host syncs in fn(): every Python-level tensor->host read (item, tolist, bool, int, float, nonzero)."""
    calls = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    original_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: calls.append("torch.nonzero") or original_nonzero(*a, **kw))
    fn()
    monkeypatch.undo()
    return calls


def packed_step(model, positions=POSITIONS):
    ids = torch.randint(3, 512, positions.shape, generator=torch.Generator().manual_seed(1))
    model(ids, position_ids=positions, shift_labels=ids, num_items_in_batch=ids.numel()).loss.backward()


@pytest.mark.parametrize("use_moe,chunk,compute,expected", [
    (False, 0, None, []),
    (False, 8, None, ["nonzero"]),  # the chunked loss drops ignored targets before the lm_head: one nonzero
    (True, 0, "loop", ["tolist", "tolist"]),  # MoE's loop: one bincount read per layer for the split sizes
    (True, 0, "grouped", []),  # grouped GEMMs: the split offsets stay on the device
])
def test_host_syncs_per_forward_backward(monkeypatch, use_moe, chunk, compute, expected):
    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2, loss_chunk_size=chunk)
    for block in model.model.layers if use_moe else ():
        block.mlp.expert_compute = compute
    if compute == "grouped" and expert_compute_for("cpu", torch.float32, model.config.hidden_size,
                                                   model.config.moe_intermediate_size) != "grouped":
        pytest.skip("this torch has no grouped matmul on CPU (the loop runs; its case above checks it)")
    assert count_syncs(monkeypatch, lambda: packed_step(model)) == expected


def test_compiled_blocks_do_not_recompile_across_mixed_batches():
    """No recompiles after the first training step and the first evaluation (grad mode is a guard: one more
    graph), over packed batches with one or several documents, under one autocast."""
    torch._dynamo.reset()
    model = tiny_model()
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.model.layers:
        block.compile(backend=counter)
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    one_doc = torch.arange(16).expand(2, -1)
    batches = [POSITIONS, one_doc, POSITIONS.flip(0), one_doc]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, position_ids=POSITIONS, labels=ids).loss.backward()
        with torch.no_grad():
            model(ids, position_ids=POSITIONS)
        first = counter.frame_count
        for positions in batches:
            model(ids, position_ids=positions, labels=ids).loss.backward()
            with torch.no_grad():
                model(ids, position_ids=positions)
    assert first == 2  # one training graph and one no-grad graph, both blocks sharing them
    assert counter.frame_count == first
    torch._dynamo.reset()


def test_long_rows_take_the_causal_kernel_and_match_dense_sdpa():
    """Rows longer than the kernel's 512-key block go through the is_causal + mask kernel: same values (fp64)."""
    positions = torch.cat([torch.arange(300), torch.arange(340)]).expand(2, -1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 640, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = packed_document_mask(positions)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (sdpa_attention(q, k, v, mask) - ref).abs().max().item() < 1e-12
