"""The MoE MLP's forward + backward time over the dense MLP's at equal active parameters, per expert compute (the
loop: one host sync per layer, one MLP call per expert; grouped: three grouped GEMMs), timed in one process.

    python scripts/bench.py --moe_layer --hidden_size 512 --num_experts 4 --num_experts_per_tok 1

The variants run interleaved, round after round, so they see the same machine load; each one's figure is the
minimum over the rounds (load only ever adds time) and the median beside it. `scripts/bench.py --moe_layer` calls it.
"""
import statistics
import time

import torch

from model.model_minimind import FeedForward, MiniMindConfig
from model.moe import MOEFeedForward, expert_compute_for


def fwd_bwd_seconds(module, x):
    """One forward + backward of `module` on `x` (a fresh leaf), in seconds."""
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    module(x).square().mean().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def moe_layer_bench(hidden_size, num_experts, top_k, batch, seq_len, rounds=20, device="cpu", dtype=torch.float32):
    """{variant: (min s, median s)} for dense, and MoE with each available expert compute; active parameters equal:
    the dense MLP's width is top_k experts' width."""
    config = MiniMindConfig(hidden_size=hidden_size, use_moe=True, num_experts=num_experts,
                            num_experts_per_tok=top_k)
    torch.manual_seed(0)
    dense = FeedForward(config, config.moe_intermediate_size * top_k).to(device, dtype)
    variants = {"dense": dense}
    computes = ["loop"] + (["grouped"] if expert_compute_for(device, dtype, hidden_size,
                                                               config.moe_intermediate_size) == "grouped" else [])
    for compute in computes:
        moe = MOEFeedForward(config, FeedForward).to(device, dtype)
        moe.expert_compute = compute
        variants[f"moe_{compute}"] = moe
    x = torch.randn(batch, seq_len, hidden_size, device=device, dtype=dtype)
    times = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up (allocator, kernels) and is dropped
        for name, module in variants.items():
            times[name].append(fwd_bwd_seconds(module, x))
    return {name: (min(t[1:]), statistics.median(t[1:])) for name, t in times.items()}


def print_moe_layer_bench(flags, rounds):
    """Run moe_layer_bench on the bench's model flags and print one line per variant, relative to dense."""
    results = moe_layer_bench(flags["hidden_size"], flags.get("num_experts", 4), flags.get("num_experts_per_tok", 1),
                              flags["batch_size"], flags["max_seq_len"], rounds, flags.get("device", "cpu"))
    dense_min, dense_median = results["dense"]
    for name, (low, median) in results.items():
        print(f"{name}: min {low * 1e3:.1f} ms ({low / dense_min:.2f}x dense), median {median * 1e3:.1f} ms "
              f"({median / dense_median:.2f}x dense)")
    return results
