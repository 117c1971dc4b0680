"""scripts/planner/cost.py: plan_layout's expert-parallel counts composed with other dimensions, against hand counts
(the rest of the layout model: tests/test_bench.py)."""
import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.moe import expert_compute_for
from scripts.bench import parse_args, print_plan
from scripts.planner import cost
from scripts.planner.cost import COMMUNICATION, PARTS, Step, plan_layout
from trainer.parallel.mesh import BY_NAME, DIMENSIONS, Dimension

GB = 2 ** 30


def moe_config():
    return MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                          n_shared_experts=1)


def routed_params(config):
    """The routed experts' parameters, counted on the real model."""
    return sum(p.numel() for name, p in MiniMindForCausalLM(config).named_parameters() if ".experts." in name)


def test_plan_layout_counts_ep_with_cp_by_hand():
    """--ep 2 --cp 2 on 4 ranks (ep carved out of dp 2): each rank holds half the routed experts; its all-to-all
    carries its half of every sequence; each expert's gradient is all-reduced over its 2 replicas (the cp peers), and
    the dense gradients over dp*cp = 4 ranks."""
    config = moe_config()
    routed = routed_params(config)
    shape = dict(seq_len=32, micro_batch=2, num_microbatches=3, act_bytes=2)
    whole = plan_layout(config, **shape, layout=dict(dp=2, cp=2))
    split = plan_layout(config, **shape, layout=dict(dp=2, cp=2, ep=2))
    assert split["params_per_rank"] == whole["params_per_rank"] - routed / 2
    comm = {k: v * GB for k, v in split["comm_gb_per_step"].items()}
    # 2 layers x 3 micro-batches x (forward + backward) x (out + back) x 32 tokens (2 x 32 / cp) x 2 slots x h 64
    # x 2 bytes x 1/2 leaving the rank
    assert comm["ep_alltoall"] == pytest.approx(2 * 3 * 2 * 2 * 32 * 2 * 64 * 2 / 2, rel=1e-12)
    # fp32 gradients of this rank's experts, ring all-reduce over 2 replicas: 2 (2-1)/2 x 4 bytes x routed/2
    assert comm["ep_replica_allreduce"] == pytest.approx(2 * (1 / 2) * 4 * routed / 2, rel=1e-12)
    dense = whole["params_per_rank"] - routed
    assert comm["dp_allreduce"] == pytest.approx(2 * (3 / 4) * 4 * dense, rel=1e-12)
    no_cp = plan_layout(config, **shape, layout=dict(dp=2, ep=2))["comm_gb_per_step"]
    assert "ep_replica_allreduce" not in no_cp  # ep = dp without cp: every expert on one rank


MOE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, use_moe=True,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1)


def first_stage_params(model, ep_rank, ep):
    """Parameters pipeline stage 0 of 2 holds on ep rank `ep_rank`: the embedding, layers 0-1, and of their routed
    experts only this rank's contiguous share (trainer/parallel/expert.py), counted on the real model."""
    per_rank, count = model.config.num_experts // ep, 0
    for name, param in model.named_parameters():
        if name.startswith("model.embed_tokens."):
            count += param.numel()
        elif name.startswith(("model.layers.0.", "model.layers.1.")):
            expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None
            if expert is None or expert // per_rank == ep_rank:
                count += param.numel()
    return count


def test_ep2_pp2_counts_each_stages_experts_by_hand():
    """--ep 2 --pp 2 with dp 4: a rank holds its stage's 2 layers with half their routed experts (the real model's
    stage 0), the all-to-alls run for its stage's 2 MoE layers only, and the experts' gradients go to their 2
    replicas (dp 4 / ep 2); hand counts."""
    config = MiniMindConfig(**MOE)
    shape = dict(seq_len=32, micro_batch=2, num_microbatches=4, zero_stage=2, act_bytes=2)
    plan = plan_layout(config, **shape, layout=dict(dp=4, pp=2, ep=2))
    assert plan["params_per_rank"] == first_stage_params(MiniMindForCausalLM(config), 0, 2)
    routed_rank = 2 * (3 * 64 * 96 * 4) / 2  # 2 layers x (gate, up, down of 4 experts) / ep
    assert plan_layout(config, **shape, layout=dict(dp=4, pp=2))["params_per_rank"] - plan["params_per_rank"] \
        == routed_rank
    comm = {name: value * GB for name, value in plan["comm_gb_per_step"].items()}
    # 2 layers x 4 micro-batches x (forward + backward) x (out + back) x 64 tokens x 2 slots x h 64 x 2 bytes x 1/2
    assert comm["ep_alltoall"] == pytest.approx(2 * 4 * 2 * 2 * 64 * 2 * 64 * 2 / 2, rel=1e-12)
    assert comm["ep_replica_allreduce"] == pytest.approx(2 * (1 / 2) * 4 * routed_rank, rel=1e-12)
    dense = plan["params_per_rank"] - routed_rank  # FSDP2 (zero 2) shards these over dp 4; the experts stay whole
    assert plan["memory_gb"]["grads"] * GB == pytest.approx(4 * (dense / 4 + routed_rank), rel=1e-12)


def test_bench_plans_ep_with_pp():
    """bench.py --plan resolves --ep 2 --pp 2 as the trainer does (FSDP2 on the dense parts) and prints its estimate."""
    args, flags = parse_args(["--plan", "--nproc", "4", "--pp", "2", "--ep", "2", "--use_moe", "1",
                              "--num_hidden_layers", "4", "--hidden_size", "64", "--num_attention_heads", "4",
                              "--num_key_value_heads", "2", "--max_seq_len", "32", "--accumulation_steps", "2"])
    plan = print_plan(args, flags)
    assert plan["comm_gb_per_step"]["ep_alltoall"] > 0 and "ep_replica_allreduce" not in plan["comm_gb_per_step"]


def test_every_dimension_has_a_cost_term():
    """Each DIMENSIONS entry has its communication function in the layout model, whose entries carry its name, and
    divides only parts the model counts: a sixth dimension without a term fails here, by name."""
    assert [d.name for d in DIMENSIONS if d.name not in COMMUNICATION] == []
    assert [name for name in COMMUNICATION if name not in BY_NAME] == []  # no term of a dimension that is gone
    assert [(d.name, p) for d in DIMENSIONS for p in d.divides if p not in PARTS] == []
    sizes = dict(dp=4, pp=2, cp=2, tp=2, ep=2)
    step = Step(moe_config(), sizes, tokens=64.0, layers=2, microbatches=3, zero_stage=3, act_bytes=2, virtual=1,
                dense=1000.0, experts=500.0)
    for name, term in COMMUNICATION.items():
        entries = term(step)
        assert entries and all(key.startswith(f"{name}_") for key in entries), (name, entries)


def test_a_dimension_without_a_cost_term_is_named(monkeypatch):
    """A DIMENSIONS entry the layout model has no communication function for stops the plan with its name; a layout
    naming no dimension too."""
    sixth = Dimension("xp", "example", "nothing", divides=("tokens",))
    monkeypatch.setattr(cost, "DIMENSIONS", DIMENSIONS + (sixth,))
    monkeypatch.setattr(cost, "BY_NAME", dict(BY_NAME, xp=sixth))
    with pytest.raises(KeyError, match="dimension xp has no communication term"):
        plan_layout(moe_config(), seq_len=32, micro_batch=2, num_microbatches=1, layout=dict(xp=2))
    monkeypatch.undo()
    with pytest.raises(KeyError, match="no parallel dimension"):
        plan_layout(moe_config(), seq_len=32, micro_batch=2, num_microbatches=1, layout=dict(xp=2))


def test_dense_layout_of_four_dimensions_by_hand():
    """dp 2 x pp 2 x cp 2 x tp 2 (16 ranks), ZeRO-1, sequence parallel, 1F1B over 3 micro-batches, bf16: what each
    dimension divides (pp the layers, tp the matrices, cp the tokens; ZeRO the states over dp x cp) and each one's
    bytes, against hand counts on the real model's first stage."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    h, V, kv, inner = 64, config.vocab_size, 2 * 16, config.intermediate_size
    params = dict(MiniMindForCausalLM(config).named_parameters())
    stage = sum(p.numel() for n, p in params.items() if n.startswith(("model.embed_tokens.", "model.layers.0.",
                                                                       "model.layers.1.")))
    plan = plan_layout(config, seq_len=64, micro_batch=2, num_microbatches=3, layout=dict(dp=2, pp=2, cp=2, tp=2),
                       zero_stage=1, act_bytes=2, sequence_parallel=True)
    assert plan["params_per_rank"] == stage / 2
    mem = {k: v * GB for k, v in plan["memory_gb"].items()}
    assert mem["optimizer"] == pytest.approx(8 * stage / 2 / 4, rel=1e-12)  # over dp x cp = 4
    assert mem["grads"] == pytest.approx(4 * stage / 2, rel=1e-12) == mem["weights"]
    tokens = 2 * 64 / 2  # a rank's half of each sequence
    per_token = (4 * h + 8 * h + 2 * kv + 4 * inner) / 2  # every saved element split by tp under sequence parallel
    assert mem["activations_per_microbatch"] == pytest.approx(tokens * 2 * per_token * 2, rel=1e-12)
    assert plan["memory_gb"]["microbatches_in_flight"] == 2  # 1F1B: min(3 micro-batches, 2 stages)
    assert mem["logits"] == pytest.approx(2 * 4 * tokens * V / 2, rel=1e-12)
    comm = {k: v * GB for k, v in plan["comm_gb_per_step"].items()}
    assert comm["dp_allreduce"] == pytest.approx(2 * (3 / 4) * 4 * stage / 2, rel=1e-12)
    assert comm["pp_p2p"] == pytest.approx(2 * 3 * tokens * h * 2, rel=1e-12)  # forward + backward, 3 micro-batches
    assert comm["cp_kv_ring"] == pytest.approx(3 * 1 * (2 * tokens * kv * 2) * 2 * 3, rel=1e-12)
    assert comm["tp_allreduce"] == pytest.approx(4 * 2 * 3 * 2 * (1 / 2) * tokens * h * 2, rel=1e-12)
    assert plan["bubble_fraction"] == pytest.approx(1 / 4)  # (pp-1) / (m + pp-1)


def saved_bytes(block, position_embeddings, rows, length, hidden):
    """Bytes autograd saves for backward in one forward of `block` on rows x length tokens, weights, input and the
    rotary tables left out; storages counted once."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(rows, length, hidden, requires_grad=True)
    cos, sin = (t[:, :length].expand(rows, -1, -1) for t in position_embeddings)
    skip |= {t.untyped_storage().data_ptr() for t in (x, cos, sin)}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, (cos, sin))
    return sum(seen.values())


def test_a_moe_layer_saves_its_experts_stacked_weights_once_per_forward():
    """What a MoE layer saves for backward, measured on the real block at two token counts (fp32): the part that does
    not grow with the tokens is the grouped GEMMs' stacked gate, up and down weights (3 x experts x h x moe width),
    the planner's expert_weight_copies, to within its few per-expert counters."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
    if expert_compute_for(torch.device("cpu"), torch.float32, 64, 96) != "grouped":  # what the block will pick
        pytest.skip("this torch runs the experts as a loop on CPU: no stacked copies")
    model = MiniMindForCausalLM(config)
    length = 32
    position_embeddings = model.model.rotary_emb(torch.zeros(1, length, 64), torch.arange(length)[None])
    block = model.model.layers[0]
    small, large = (saved_bytes(block, position_embeddings, rows, length, 64) for rows in (2, 6))
    per_token = (large - small) / (4 * length)
    constant = small - per_token * 2 * length
    stacked = 4 * 3 * 4 * 64 * 96  # fp32 bytes: gate, up and down of the 4 experts
    assert cost.expert_weight_copies(config, cost.layout_sizes({})) * 4 == stacked
    assert stacked <= constant <= stacked * 1.01, (constant, stacked)
