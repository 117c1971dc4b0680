"""scripts/benchmarks/moe.py and moe_dense.py: the variants they time and their equal active parameters (no timing
is asserted)."""
import math

import pytest
import torch

from model.model_minimind import FeedForward, MiniMindConfig, MiniMindForCausalLM
from model.moe import expert_compute_for
from scripts.benchmarks.moe import moe_layer_bench
from scripts.benchmarks.moe_dense import GRID, compute_printed, dense_twin, moe_flags
from scripts.benchmarks.run import BENCH_DEFAULTS, trainer_args
from trainer.plan.model_config import build_config


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


def active_parameters(model, num_experts, top_k):
    """Parameters one token passes through: all but the routed experts, plus top_k of num_experts experts' share."""
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    return sum(p.numel() for p in model.parameters()) - routed + routed * top_k // num_experts


@pytest.mark.parametrize("num_experts,top_k", GRID)
def test_the_dense_twin_has_the_moe_models_active_parameters(num_experts, top_k):
    flags = moe_flags(dict(BENCH_DEFAULTS, device="cpu", dtype="float32"), num_experts, top_k)  # h512 L8, as benched
    with torch.device("meta"):  # shapes only: the parameter counts of the real models, no memory
        moe = MiniMindForCausalLM(build_config(trainer_args(flags)))
        dense = MiniMindForCausalLM(build_config(trainer_args(dense_twin(flags))))
    hidden, layers, width = 512, 8, math.ceil(512 * math.pi / 64) * 64  # MiniMind's expert width at h512: 1664
    assert dense.config.intermediate_size == top_k * width and not dense.config.use_moe
    router = layers * hidden * num_experts  # the MoE's gate per layer: the only active parameters dense lacks
    assert active_parameters(moe, num_experts, top_k) == sum(p.numel() for p in dense.parameters()) + router
    experts = sum(p.numel() for name, p in moe.named_parameters() if ".mlp.experts." in name)
    assert experts == layers * num_experts * 3 * hidden * width  # gate, up, down projections of each expert


def test_the_printed_expert_compute_is_read_from_the_trainer_log(tmp_path):
    log = tmp_path / "bench.log"
    log.write_text("model: 1.0M\nMoE experts: torch's grouped matmul, no host sync (grouped), float32\nstep 1\n")
    assert compute_printed(str(log)) == "grouped"
    log.write_text("step 1\n")  # a dense run prints no expert line
    assert compute_printed(str(log)) == "-"
