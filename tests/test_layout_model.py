"""scripts/layout_model.py: plan_layout's expert-parallel counts composed with other dimensions, against hand counts
(the rest of the layout model: tests/test_bench.py)."""
import pytest

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.layout_model import plan_layout

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
    shape = dict(seq_len=32, micro_batch=2, num_microbatches=3, dp=2, cp=2, act_bytes=2)
    whole, split = plan_layout(config, **shape), plan_layout(config, **shape, ep=2)
    assert split["params_per_rank"] == whole["params_per_rank"] - routed / 2
    comm = {k: v * GB for k, v in split["comm_gb_per_step"].items()}
    # 2 layers x 3 micro-batches x (forward + backward) x (out + back) x 32 tokens (2 x 32 / cp) x 2 slots x h 64
    # x 2 bytes x 1/2 leaving the rank
    assert comm["ep_alltoall"] == pytest.approx(2 * 3 * 2 * 2 * 32 * 2 * 64 * 2 / 2, rel=1e-12)
    # fp32 gradients of this rank's experts, ring all-reduce over 2 replicas: 2 (2-1)/2 x 4 bytes x routed/2
    assert comm["ep_replica_allreduce"] == pytest.approx(2 * (1 / 2) * 4 * routed / 2, rel=1e-12)
    dense = whole["params_per_rank"] - routed
    assert comm["dp_allreduce"] == pytest.approx(2 * (3 / 4) * 4 * dense, rel=1e-12)
    no_cp = plan_layout(config, **dict(shape, cp=1), ep=2)["comm_gb_per_step"]
    assert "ep_replica_allreduce" not in no_cp  # ep = dp without cp: every expert on one rank
