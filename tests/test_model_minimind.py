"""MiniMind model tests: parity with transformers' Qwen3 / Qwen3-MoE, loss and aux-loss semantics, hooks, defaults."""
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from model.hf_convert import hf_to_minimind, minimind_to_hf
from model.model_minimind import Attention, FeedForward, MiniMindConfig, MiniMindForCausalLM, packed_document_mask
from model.moe import MOEFeedForward
from tests.helpers.models import DOC_LENGTHS, VOCAB, batch, max_diff, minimind, packed_row, tiny_config, to_hf_model

TOL = 1e-4


def padding_mask(bsz=2, seq=24):
    """Row 0 left-padded by 5, row 1 right-padded by 4."""
    mask = torch.ones(bsz, seq, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, -4:] = 0
    return mask


# ----------------------------------------------------------------------------------------------
# Parity with transformers Qwen3 (dense)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
def test_dense_minimind_to_qwen3_parity(tie):
    model = minimind(tiny_config(tie_word_embeddings=tie))
    hf = to_hf_model(model)
    x, mask = batch(), padding_mask()
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL
        ours, ref = model(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits
    assert torch.isfinite(ours).all()
    assert max_diff(ours, ref, mask.bool()) < TOL  # padded positions carry no meaning


@pytest.mark.parametrize("tie", [True, False])
def test_dense_qwen3_to_minimind_parity(tie):
    torch.manual_seed(0)
    hf_config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                            tie_word_embeddings=tie, initializer_range=0.1, attn_implementation="eager")
    hf = Qwen3ForCausalLM(hf_config).eval()
    config, sd = hf_to_minimind(hf.state_dict(), hf.config)
    assert config.tie_word_embeddings == tie and config.intermediate_size == 128
    model = MiniMindForCausalLM(config).eval()
    model.load_state_dict(sd, strict=True)
    x, mask = batch(), padding_mask()
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL
        assert max_diff(model(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits, mask.bool()) < TOL


# ----------------------------------------------------------------------------------------------
# Parity with transformers Qwen3-MoE
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k,norm", [(2, True), (2, False), (1, True), (1, False)])
def test_moe_minimind_to_qwen3moe_parity(top_k, norm):
    model = minimind(tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=norm,
                                 moe_intermediate_size=96))
    hf = to_hf_model(model)
    x, mask = batch(), padding_mask()
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL
        assert max_diff(model(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits, mask.bool()) < TOL


@pytest.mark.parametrize("top_k,norm", [(2, True), (2, False), (1, True), (1, False)])
def test_moe_qwen3moe_to_minimind_parity(top_k, norm):
    torch.manual_seed(0)
    hf_config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=norm, rope_theta=10000.0,
                               initializer_range=0.1, attn_implementation="eager")
    hf = Qwen3MoeForCausalLM(hf_config).eval()
    config, sd = hf_to_minimind(hf.state_dict(), hf.config)
    assert config.use_moe and config.num_experts_per_tok == top_k and config.norm_topk_prob == norm
    model = MiniMindForCausalLM(config).eval()
    model.load_state_dict(sd, strict=True)
    x = batch()
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) < TOL


def test_moe_gradients_match_qwen3moe():
    model = minimind(tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96))
    hf = to_hf_model(model)
    x = batch(seq=16)
    w = torch.randn(2, 16, VOCAB, generator=torch.Generator().manual_seed(3))
    (model(x).logits * w).sum().backward()
    (hf(x).logits * w).sum().backward()
    layer, ref = model.model.layers[1].mlp, hf.model.layers[1].mlp
    assert max_diff(layer.gate.weight.grad, ref.gate.weight.grad) < TOL
    for e in range(4):
        if hasattr(ref.experts, "gate_up_proj"):  # transformers 5: fused expert tensors
            gate_up, down = ref.experts.gate_up_proj.grad[e], ref.experts.down_proj.grad[e]
        else:  # transformers 4.x: one Linear per expert
            expert = ref.experts[e]
            gate_up = torch.cat([expert.gate_proj.weight.grad, expert.up_proj.weight.grad])
            down = expert.down_proj.weight.grad
        assert max_diff(layer.experts[e].gate_proj.weight.grad, gate_up[:96]) < TOL
        assert max_diff(layer.experts[e].up_proj.weight.grad, gate_up[96:]) < TOL
        assert max_diff(layer.experts[e].down_proj.weight.grad, down) < TOL


def test_shared_experts_have_no_qwen3moe_equivalent():
    model = minimind(tiny_config(use_moe=True, n_shared_experts=1))
    assert "model.layers.0.mlp.shared_experts.0.gate_proj.weight" in model.state_dict()
    with pytest.raises(ValueError, match="shared"):
        minimind_to_hf(model.state_dict(), model.config)


# ----------------------------------------------------------------------------------------------
# Loss semantics
# ----------------------------------------------------------------------------------------------
def test_labels_loss_is_shifted_mean_ce():
    model = minimind(tiny_config())
    x = batch()
    labels = x.clone()
    labels[0, :7] = -100
    out = model(x, labels=labels)
    logits = out.logits.float()
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert abs(out.loss.item() - ref.item()) < 1e-5


def test_shift_labels_with_num_items_is_ce_sum_over_items():
    model = minimind(tiny_config())
    x = batch()
    targets = F.pad(x[:, 1:], (0, 1), value=-100)
    targets[1, 10:] = -100
    out = model(x, shift_labels=targets, num_items_in_batch=100)
    ce_sum = F.cross_entropy(out.logits.float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100,
                             reduction="sum")
    assert abs(out.loss.item() - ce_sum.item() / 100) < 1e-5


# ----------------------------------------------------------------------------------------------
# MoE sequence-level aux loss
# ----------------------------------------------------------------------------------------------
def _capture_gate_logits(model):
    logits = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: logits.append(out.detach()))
    return logits


def _seq_aux_by_hand(gate_logits, bsz, seq_len, num_experts, top_k, coef):
    """aux = mean_b coef * E * sum_i f_bi * P_bi, f = routed fraction / k, P = mean router prob."""
    probs = torch.softmax(gate_logits.double(), dim=-1).view(bsz, seq_len, num_experts)
    total = 0.0
    for b in range(bsz):
        chosen = probs[b].topk(top_k, dim=-1).indices
        aux_b = 0.0
        for i in range(num_experts):
            f = (chosen == i).sum().item() / (seq_len * top_k)
            p = probs[b, :, i].mean().item()
            aux_b += f * p
        total += coef * num_experts * aux_b
    return total / bsz


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_aux_loss_is_sequence_level(top_k):
    config = tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=top_k, router_aux_loss_coef=0.1)
    model = minimind(config)
    gate_logits = _capture_gate_logits(model)
    x = batch(bsz=3, seq=16)
    out = model(x)
    expected = sum(_seq_aux_by_hand(g, 3, 16, 4, top_k, 0.1) for g in gate_logits)
    assert out.aux_loss.dim() == 0
    assert abs(out.aux_loss.item() - expected) < 1e-6
    out.aux_loss.backward()  # differentiable through the router probabilities
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_moe_aux_loss_hooks_for_context_parallel():
    """Two sequence halves with seq_len_scale=2 and summed router stats reproduce the full-sequence aux loss."""
    torch.manual_seed(0)
    config = tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)
    moe = MOEFeedForward(config, FeedForward)
    x = torch.randn(2, 16, 64)
    gate_logits = moe.gate(x.reshape(-1, 64)).detach()
    expected = _seq_aux_by_hand(gate_logits, 2, 16, 4, 2, 0.1)

    first_half = []
    moe.seq_len_scale = 2
    moe.reduce_router_stats = lambda t: first_half.append(t.detach()) or t
    moe(x[:, :8])
    calls = iter(first_half)
    moe.reduce_router_stats = lambda t: t + next(calls)  # stands in for the all-reduce over the cp group
    moe(x[:, 8:])
    assert abs(moe.aux_loss.item() - expected) < 1e-6


def _moe_by_loop(moe, x_flat, topk_idx, topk_weight):
    """The old dispatch: one torch.where per expert, outputs added back by index_add_."""
    y = torch.zeros_like(x_flat)
    for e, expert in enumerate(moe.experts):
        token_idx, slot = torch.where(topk_idx == e)
        y.index_add_(0, token_idx, expert(x_flat[token_idx]) * topk_weight[token_idx, slot, None])
    return y


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_sorted_dispatch_matches_per_expert_loop(dtype, tol, top_k):
    """Outputs and all gradients equal the per-expert loop; expert 3 gets no token and still gets a (zero) grad."""
    torch.manual_seed(0)
    moe = MOEFeedForward(tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=top_k), FeedForward).to(dtype)
    x = torch.randn(40, 64, dtype=dtype, requires_grad=True)
    topk_idx = (torch.randint(0, 3, (40, 1)) + torch.arange(top_k)) % 3  # distinct experts per token, never 3
    topk_weight = torch.rand(40, top_k, dtype=dtype, requires_grad=True)
    grads = []
    for fn in (moe.dispatch, lambda *a: _moe_by_loop(moe, *a)):
        moe.zero_grad(set_to_none=True)
        out = fn(x, topk_idx, topk_weight)
        params = [x, topk_weight] + [p for e in moe.experts for p in e.parameters()]
        grads.append((out, torch.autograd.grad((out * out.detach().sin()).sum(), params, allow_unused=True)))
    (out, g), (ref_out, ref_g) = grads
    # fp32: an expert's matmul over a different number of rows may block its sums differently (~1e-6 relative)
    assert max_diff(out, ref_out) < tol * max(1.0, ref_out.abs().max().item())
    assert g[-1] is not None and g[-1].abs().max().item() == 0.0  # expert 3 took part with zero rows
    for a, b in zip(g[:-3], ref_g[:-3]):
        assert max_diff(a, b) < tol * max(1.0, b.abs().max().item())


def test_dense_aux_loss_is_zero_tensor():
    out = minimind(tiny_config())(batch())
    assert torch.is_tensor(out.aux_loss) and out.aux_loss.dim() == 0 and out.aux_loss.item() == 0.0


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_moe", [False, True])
def test_greedy_generate_cache_and_qwen3_agree(use_moe):
    model = minimind(tiny_config(use_moe=use_moe, num_experts_per_tok=2))
    hf = to_hf_model(model)
    prompt = batch(seq=6)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # left padding, as generation expects
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kw)
    without_cache = model.generate(prompt, use_cache=False, **kw)
    reference = hf.generate(prompt, use_cache=True, **kw)
    assert with_cache.shape == (2, 14)
    assert torch.equal(with_cache, without_cache)
    assert torch.equal(with_cache, reference)


def full_forward_greedy(model, prompt, mask, steps):
    """The reference decoder: a full forward over the whole sequence each step (no cache), argmax of the last logits."""
    ids, mask, logits = prompt, mask, []
    with torch.no_grad():
        for _ in range(steps):
            last = model(ids, attention_mask=mask).logits[:, -1].float()
            logits.append(last)
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids, torch.stack(logits, dim=1)


@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("left_pad", [0, 3])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_generate_with_cache_equals_full_forward_loop(use_moe, left_pad, cache_implementation):
    """Whatever name the installed transformers gives the KV cache (past_key_values, cache), generate() must use it:
    each step's scores equal a full forward over the sequence so far (fp32), so the tokens are the same."""
    model = minimind(tiny_config(use_moe=use_moe, num_experts_per_tok=2), seed=3)
    prompt = batch(bsz=1 if not left_pad else 3, seq=7, seed=4)
    mask = torch.ones_like(prompt)
    mask[0, :left_pad] = 0  # row 0 left-padded, as a batch of prompts of different lengths is
    expected, expected_logits = full_forward_greedy(model, prompt, mask, steps=10)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                         pad_token_id=0, use_cache=True, cache_implementation=cache_implementation,
                         output_logits=True, return_dict_in_generate=True)
    scores = torch.stack(out.logits, dim=1).float()  # raw logits (scores are after min_new_tokens masks EOS)
    assert max_diff(scores, expected_logits) < TOL
    assert torch.equal(out.sequences, expected)


def test_forward_rejects_an_unknown_keyword():
    """A keyword the model does not know (a renamed cache, say) is an error, not silently dropped."""
    model = minimind(tiny_config())
    with pytest.raises(TypeError, match="kv_cache"):
        model(batch(seq=4), kv_cache=object())


def test_kv_cache_forward_matches_full_forward():
    model = minimind(tiny_config())
    x = batch(seq=12)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :8], use_cache=True)
        step = model(x[:, 8:], past_key_values=out.past_key_values, use_cache=True).logits  # Lq=4 < Lk=12
    assert max_diff(step, full[:, 8:]) < TOL


# ----------------------------------------------------------------------------------------------
# Attention hook
# ----------------------------------------------------------------------------------------------
def explicit_causal_attention(q, k, v, attention_mask=None):
    """Independent reference: GQA by repeat_interleave, causal mask aligned to the end of the keys."""
    lq, lk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    if attention_mask is not None:  # a 4-D document mask as it is, a 2-D padding mask over the keys
        allowed = allowed & (attention_mask if attention_mask.dim() == 4 else attention_mask[:, None, None, :].bool())
    scores = scores.masked_fill(~allowed, -1e30)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("flash_attn", [True, False])
def test_packed_row_gives_each_document_its_own_logits(use_moe, flash_attn):
    model = minimind(tiny_config(use_moe=use_moe, flash_attn=flash_attn))
    row, positions, docs = packed_row()
    with torch.no_grad():
        packed = model(row, position_ids=positions).logits
        alone = torch.cat([model(doc).logits for doc in docs], dim=1)
        unmasked = model(row).logits
    # fp32: the masked and the plain causal kernel sum the same terms in another order (~1e-6 of logits ~1)
    assert max_diff(packed, alone) < 1e-5
    assert max_diff(unmasked[:, DOC_LENGTHS[0]:], alone[:, DOC_LENGTHS[0]:]) > 1e-3  # the mask is what does it


@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_branched_row_gives_each_branch_the_logits_of_its_own_row(use_moe, flash_attn):
    """Position ids that step back to p > 0 start a branch off the document's first segment (a prompt run once for
    several answers: trainer/core/shared_prefix.py): [prompt, answer a, answer b from the prompt's last token,
    answer c likewise], then a second document; each branch's logits equal those of its own row [prompt, answer]."""
    model = minimind(tiny_config(use_moe=use_moe, flash_attn=flash_attn))
    prompt, answers, other = batch(1, 7, seed=1), [batch(1, n, seed=2 + n) for n in (5, 3, 6)], batch(1, 4, seed=9)
    rows = [torch.cat([prompt, answer], 1) for answer in answers]
    row = torch.cat([rows[0], *(torch.cat([prompt[:, -1:], a], 1) for a in answers[1:]), other], 1)
    positions = torch.cat([torch.arange(12), torch.arange(6, 10), torch.arange(6, 13), torch.arange(4)])[None]
    with torch.no_grad():
        shared, alone = model(row, position_ids=positions).logits, [model(r).logits for r in rows]
        plain = model(other).logits
    got = [shared[:, :12], shared[:, 12:16], shared[:, 16:23]]
    expected = [alone[0], alone[1][:, 6:], alone[2][:, 6:]]  # from the prompt's last token on
    for a, b in zip(got, expected):  # fp32: other kernels, another order of the same sums
        assert max_diff(a, b) < 1e-5
    assert max_diff(shared[:, 23:], plain) < 1e-5
    # by hand: a query sees its own segment, and its document's first segment before the position its branch starts at
    mask = packed_document_mask(torch.tensor([[0, 1, 2, 3, 1, 2, 1, 0, 1]]))[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 1, 1, 0, 0, 0],
                             [1, 0, 0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("use_moe", [False, True])
def test_packed_row_matches_qwen3_packed_sequences(use_moe):
    """transformers detects packed sequences from the same position ids (no attention_mask, no cache)."""
    model = minimind(tiny_config(use_moe=use_moe))
    hf = to_hf_model(model)
    row, positions, _ = packed_row()
    with torch.no_grad():
        ours = model(row, position_ids=positions).logits
        ref = hf(row, position_ids=positions, use_cache=False).logits
    assert max_diff(ours, ref) < TOL


def test_packed_document_gradients_stay_in_their_document():
    """The loss of the last document has no gradient on the earlier documents' embeddings."""
    model = minimind(tiny_config())
    row, positions, _ = packed_row()
    embeds = model.model.embed_tokens(row).detach().requires_grad_()
    earlier = sum(DOC_LENGTHS[:-1])
    labels = torch.full_like(row, -100)
    labels[:, earlier + 1:] = row[:, earlier + 1:]  # targets predicted from inside the last document
    model(inputs_embeds=embeds, position_ids=positions, labels=labels).loss.backward()
    assert embeds.grad[:, :earlier].abs().max().item() == 0.0
    assert embeds.grad[:, earlier:].abs().max().item() > 0.0


def test_position_ids_without_restart_keep_plain_causal_attention():
    """Context parallel's positions (global, increasing, not from 0) are not read as documents."""
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(packed_document_mask(torch.arange(8, 24).unsqueeze(0))[0, 0], causal)
    assert torch.equal(packed_document_mask(torch.arange(16).unsqueeze(0))[0, 0], causal)
    mask = packed_document_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(mask, expected.bool())


def test_attn_fn_swap_gives_same_logits():
    model = minimind(tiny_config())
    x, mask = batch(), padding_mask()
    with torch.no_grad():
        base, base_masked = model(x).logits, model(x, attention_mask=mask).logits
        calls = []

        def counted(q, k, v, attention_mask=None):
            calls.append(1)
            return explicit_causal_attention(q, k, v, attention_mask)

        for module in model.modules():
            if isinstance(module, Attention):
                module.attn_fn = counted
        swapped, swapped_masked = model(x).logits, model(x, attention_mask=mask).logits
    assert len(calls) == 2 * model.config.num_hidden_layers  # the hook is what runs
    assert max_diff(base, swapped) < TOL
    assert max_diff(base_masked, swapped_masked, mask.bool()) < TOL


def test_attn_fn_receives_unrepeated_gqa_heads():
    config = tiny_config()
    model = minimind(config)
    shapes = []

    def checked(q, k, v, attention_mask=None):
        shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return explicit_causal_attention(q, k, v, attention_mask)

    for module in model.modules():
        if isinstance(module, Attention):
            module.attn_fn = checked
    with torch.no_grad():
        model(batch(seq=10))
    assert shapes and all(s == ((2, 4, 10, 16), (2, 2, 10, 16), (2, 2, 10, 16)) for s in shapes)


# ----------------------------------------------------------------------------------------------
# Config and state dict layout
# ----------------------------------------------------------------------------------------------
def test_config_defaults_and_validate():
    c = MiniMindConfig()
    # minimind-3: intermediate = ceil(768 * pi / 64) * 64 = ceil(37.70) * 64 = 38 * 64 = 2432, experts the same size
    shape = (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.head_dim, c.intermediate_size)
    assert shape == (768, 8, 6400, 96, 2432)
    assert (c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.n_shared_experts) == (2432, 4, 1, 0)
    assert (c.router_aux_loss_coef, c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (5e-4, 1e6, 1e-6, True)
    assert MiniMindConfig(hidden_size=512).intermediate_size == 1664  # ceil(512 * pi / 64) = ceil(25.13) = 26
    assert c.validate() is None
    assert "divisible by num_attention_heads" in MiniMindConfig(hidden_size=100, num_attention_heads=8).validate()
    assert MiniMindConfig(hidden_size=100, num_attention_heads=8, num_key_value_heads=2, head_dim=16).validate() is None
    assert "num_key_value_heads" in MiniMindConfig(num_attention_heads=8, num_key_value_heads=3).validate()
    assert "num_experts_per_tok" in MiniMindConfig(use_moe=True, num_experts=2, num_experts_per_tok=3).validate()


def minimind3_param_count(use_moe):
    """By hand from minimind-3's shapes: tied 6400x768 embedding, 8 layers of GQA (8 q / 4 kv heads of 96) + SwiGLU."""
    hidden, inter, vocab, layers, head_dim = 768, 2432, 6400, 8, 96
    attn = 2 * hidden * 8 * head_dim + 2 * hidden * 4 * head_dim + 2 * head_dim  # q,o + k,v + q_norm,k_norm
    mlp = 3 * hidden * inter
    ffn = 4 * mlp + 4 * hidden if use_moe else mlp  # 4 experts + router
    return vocab * hidden + layers * (attn + ffn + 2 * hidden) + hidden


@pytest.mark.parametrize("use_moe,millions", [(False, "63.9"), (True, "198.4")])
def test_default_parameter_count_is_minimind3(use_moe, millions):
    with torch.device("meta"):  # shapes only: no 800 MB of random weights
        model = MiniMindForCausalLM(MiniMindConfig(use_moe=use_moe))
    count = sum(p.numel() for p in model.parameters())
    assert count == minimind3_param_count(use_moe)
    assert f"{count / 1e6:.1f}" == millions


def test_init_is_seeded_and_tied():
    a, b = minimind(tiny_config(initializer_range=0.02)), minimind(tiny_config(initializer_range=0.02))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert abs(sa["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
