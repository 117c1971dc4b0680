"""MOEFeedForward's expert compute (grouped GEMM or the loop) against the old per-expert loop in float64, the routing
bias of aux-loss-free balancing, and the per-expert token counts."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.hf_convert import minimind_to_hf
from model.model_minimind import FeedForward, MiniMindConfig, MiniMindForCausalLM
from model.moe import MOEFeedForward, expert_compute_for, grouped_mm_op
from model.weights.files import WeightsError
from model.weights.shapes import load_checked

HIDDEN, INTER = 64, 96


def make_moe(top_k, shared, seed=0):
    torch.manual_seed(seed)
    config = MiniMindConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=4, use_moe=True,
                            num_experts_per_tok=top_k, n_shared_experts=shared)
    return MOEFeedForward(config, FeedForward)


def old_loop_f64(moe, x, absolute=False):
    """MiniMind's dispatch as it was (a loop over experts, each on its tokens) in float64, on the routing of the
    float64 router. absolute: every weight and input by its absolute value and SiLU(a) by |a| (a magnitude bound
    of each output element, for the rounding bound)."""
    cfg = moe.config
    x = x.double().reshape(-1, HIDDEN)
    probs = F.softmax(x @ moe.gate.weight.double().T, dim=-1)
    weight, idx = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    prep = (lambda t: t.double().abs()) if absolute else (lambda t: t.double())
    act = torch.abs if absolute else F.silu
    x = prep(x)

    def mlp(e, rows):
        return (act(rows @ prep(e.gate_proj.weight).T) * (rows @ prep(e.up_proj.weight).T)) @ prep(e.down_proj.weight).T
    y = torch.zeros_like(x)
    for i, expert in enumerate(moe.experts):
        token, slot = (idx == i).nonzero(as_tuple=True)
        y[token] += mlp(expert, x[token]) * weight[token, slot, None]
    for expert in getattr(moe, "shared_experts", []):
        y = y + mlp(expert, x)
    return y


def rounding_bound(moe, x, unit):
    """First-order forward error of the fp computation with unit roundoff `unit`: each GEMM adds its inner length
    times unit of the absolute products (gamma_n), SiLU's slope is at most 1.1, and the weighting, the sums over a
    token's experts and the shared experts a few units more; 3 * (H + I) covers them all with room."""
    return 3 * (HIDDEN + INTER) * unit * old_loop_f64(moe, x, absolute=True)


@pytest.mark.parametrize("top_k,shared", [(1, 0), (2, 0), (1, 1), (2, 1)])
@pytest.mark.parametrize("compute", ["grouped", "loop"])
def test_dispatch_matches_the_old_loop_in_float64(top_k, shared, compute):
    if compute == "grouped" and expert_compute_for("cpu", torch.float32, HIDDEN, INTER) != "grouped":
        pytest.skip("this torch has no grouped matmul on CPU")
    moe = make_moe(top_k, shared)
    moe.expert_compute = compute
    x = torch.randn(3, 17, HIDDEN)
    y = moe(x).reshape(-1, HIDDEN)
    ref = old_loop_f64(moe, x)
    assert ((y.double() - ref).abs() <= rounding_bound(moe, x, 2.0 ** -24)).all()


@pytest.mark.parametrize("top_k,shared", [(1, 0), (2, 1)])
def test_grouped_equals_the_loop_bitwise_in_fp32_forward_and_backward(top_k, shared):
    if expert_compute_for("cpu", torch.float32, HIDDEN, INTER) != "grouped":
        pytest.skip("this torch has no grouped matmul on CPU")
    grouped, loop = make_moe(top_k, shared), make_moe(top_k, shared)
    grouped.expert_compute, loop.expert_compute = "grouped", "loop"
    x = torch.randn(2, 33, HIDDEN)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [grouped(xs[0]), loop(xs[1])]
    grad = torch.randn_like(outs[0])
    for out in outs:
        out.backward(grad)
    assert torch.equal(outs[0], outs[1])  # the same per-expert GEMMs on the same rows: the same roundings
    assert torch.equal(xs[0].grad, xs[1].grad)
    for (name, a), b in zip(grouped.named_parameters(), loop.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_an_expert_without_tokens_keeps_a_zero_gradient():
    moe = make_moe(1, 0)
    with torch.no_grad():
        moe.gate.weight[3] = -1e3 * moe.gate.weight[0].sign()  # expert 3 never wins for x = the gate row's sign
    x = moe.gate.weight[0].detach().sign().expand(2, 5, HIDDEN).clone()
    moe(x).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in moe.experts[3].parameters())
    assert moe.experts[0].down_proj.weight.grad.abs().sum() > 0


def test_grouped_under_bf16_autocast_within_bf16_rounding():
    if expert_compute_for("cpu", torch.bfloat16, HIDDEN, INTER) != "grouped":
        pytest.skip("this torch has no bf16 grouped matmul on CPU")
    moe = make_moe(2, 1)
    x = torch.randn(2, 9, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x).reshape(-1, HIDDEN)
    # the experts' matmuls in bf16 (inputs and weights rounded to bf16: 2 more units each), the router in fp32
    assert ((y.double() - old_loop_f64(moe, x)).abs() <= rounding_bound(moe, x, 2.0 ** -8) * 2).all()


def test_the_routing_bias_picks_the_expert_but_not_the_gate_weight():
    moe = make_moe(2, 0)
    moe.config.norm_topk_prob = False
    moe.expert_bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is in every token's top 2
    x = torch.randn(1, 6, HIDDEN)
    y = moe(x).reshape(-1, HIDDEN).double()
    xd = x.double().reshape(-1, HIDDEN)
    probs = F.softmax(xd @ moe.gate.weight.double().T, dim=-1)
    other = probs[:, :3].argmax(dim=-1)  # the second choice: the best of the others, by the unbiased score
    ref = torch.zeros_like(xd)
    for t in range(xd.shape[0]):
        for e in (3, int(other[t])):
            expert = moe.experts[e]
            h = F.silu(xd[t] @ expert.gate_proj.weight.double().T) * (xd[t] @ expert.up_proj.weight.double().T)
            ref[t] += probs[t, e] * (h @ expert.down_proj.weight.double().T)
    assert ((y - ref).abs() <= rounding_bound(moe, x, 2.0 ** -24)).all()


def test_the_bias_is_saved_and_loads_into_a_plain_model():
    moe = make_moe(1, 0)
    assert "expert_bias" not in moe.state_dict()  # MiniMind's keys unless the bias is on
    moe.expert_bias = torch.tensor([0.5, -0.5, 0.25, 0.0])
    fresh = make_moe(1, 0, seed=1)
    fresh.load_state_dict(moe.state_dict())
    assert torch.equal(fresh.expert_bias, moe.expert_bias)


def test_weights_with_a_routing_bias_load_checked_into_a_fresh_model():
    config = MiniMindConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, moe_intermediate_size=INTER)
    trained = MiniMindForCausalLM(config)
    trained.model.layers[0].mlp.expert_bias = torch.tensor([0.5, -0.5, 0.0, 0.25])
    fresh = load_checked(MiniMindForCausalLM(config), trained.state_dict(), "w.pth")
    assert torch.equal(fresh.model.layers[0].mlp.expert_bias, torch.tensor([0.5, -0.5, 0.0, 0.25]))


def test_a_model_with_a_routing_bias_is_not_exported_as_qwen3_moe():
    config = MiniMindConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, moe_intermediate_size=INTER)
    model = MiniMindForCausalLM(config)
    model.model.layers[0].mlp.expert_bias = torch.zeros(4)
    with pytest.raises(WeightsError, match="routing bias"):
        minimind_to_hf(model.state_dict(), config)


def test_routed_tokens_count_training_forwards_once_even_when_recomputed():
    moe = make_moe(2, 0)
    x = torch.randn(2, 11, HIDDEN, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # backward recomputes the forward
    moe(x)
    probs = F.softmax(x.detach().double().reshape(-1, HIDDEN) @ moe.gate.weight.double().T, dim=-1)
    expected = 2 * torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=4)
    assert torch.equal(moe.routed_tokens, expected.float())
    moe.eval()
    moe(x)  # evaluation does not count
    assert torch.equal(moe.routed_tokens, expected.float())


def test_cpu_picks_the_grouped_matmul_where_torch_has_it():
    expected = "grouped" if grouped_mm_op() is not None else "loop"
    assert expert_compute_for("cpu", torch.float32, HIDDEN, INTER) == expected
