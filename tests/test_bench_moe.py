"""scripts/bench_moe.py: the variants it times and their equal active parameters (no timing is asserted)."""
import torch

from model.model_minimind import FeedForward, MiniMindConfig, expert_compute_for
from scripts.bench_moe import moe_layer_bench


def test_dense_width_equals_the_active_experts_width():
    config = MiniMindConfig(hidden_size=64, use_moe=True, num_experts=4, num_experts_per_tok=2)
    dense = FeedForward(config, config.moe_intermediate_size * 2)
    expert = FeedForward(config, config.moe_intermediate_size)
    assert sum(p.numel() for p in dense.parameters()) == 2 * sum(p.numel() for p in expert.parameters())


def test_every_available_compute_is_timed():
    results = moe_layer_bench(64, 4, 2, batch=1, seq_len=8, rounds=1)
    expected = {"dense", "moe_loop"} | ({"moe_grouped"} if expert_compute_for(
        "cpu", torch.float32, 64, MiniMindConfig(hidden_size=64, use_moe=True).moe_intermediate_size) == "grouped"
        else set())
    assert set(results) == expected
    assert all(0 < low <= median for low, median in results.values())
