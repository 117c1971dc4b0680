"""The MoE model's step time over the dense model's at equal active parameters per token, through the real trainer,
per expert compute (the loop before, torch's grouped matmul after); and expert parallel against plain data parallel.

    python scripts/bench.py --moe_vs_dense --dtype float32 --steps 3 --warmup 2 --repeats 2
    python scripts/bench.py --ep_vs_dp --nproc 2 --dtype float32 --steps 3 --warmup 2 --repeats 2

--moe_vs_dense runs, for each (num_experts, top_k) of GRID, the dense twin (dense_twin: intermediate_size = top_k x
moe_intermediate_size) and the MoE model once per expert compute, alternating --repeats times so every variant sees
the same machine load. The ratio is the median over repeats of MoE step time / dense step time (medians of a run's
steps). `scripts/bench.py` calls these with its `bench_one` (one trainer run, one results line).
"""
import json
import os
import statistics
import time

from model.moe import expert_compute_for
from scripts.benchmarks.run import trainer_args
from trainer.plan.model_config import build_config
from trainer.plan.resolve import resolve

GRID = ((4, 1), (4, 2), (8, 1), (8, 2))  # (num_experts, top_k): the 4 and 8 experts, top-1 and top-2
MOE_ONLY_FLAGS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "ep", "expert_compute",
                  "router_balance", "router_bias_rate")


def dense_twin(flags):
    """The dense model's trainer flags with the MoE model's active MLP parameters per token: intermediate_size =
    (top_k + shared experts) x moe_intermediate_size; the router (hidden x experts per layer) is the MoE's own."""
    config = build_config(trainer_args(flags))
    width = (config.num_experts_per_tok + config.n_shared_experts) * config.moe_intermediate_size
    dense = {name: value for name, value in flags.items() if name not in MOE_ONLY_FLAGS}
    return dict(dense, use_moe=0, intermediate_size=width)


def moe_flags(flags, num_experts, top_k):
    """The MoE model of one grid point: `flags` with use_moe and the expert counts set."""
    return dict(flags, use_moe=1, num_experts=num_experts, num_experts_per_tok=top_k)


def computes_available(flags):
    """The expert computes this machine runs for `flags`' model and dtype: the loop, and grouped where torch has it."""
    run = trainer_args(flags)
    config, dtype = build_config(run), resolve(run, 1).model.dtype
    grouped = expert_compute_for(run.device, dtype, config.hidden_size, config.moe_intermediate_size) == "grouped"
    return ("loop", "grouped") if grouped else ("loop",)


def compute_printed(log_path):
    """The expert compute the trainer printed in its log ("MoE experts: ... (grouped), float32"), or "-"."""
    with open(log_path) as f:
        line = next((line for line in f if line.startswith("MoE experts:")), "")
    return ",".join(c for c in ("grouped", "loop") if f"({c})" in line) or "-"


def median_ratio(pairs):
    """Median over repeats of (variant step time / reference step time): each pair ran back to back."""
    return statistics.median(variant["step_time_median"] / reference["step_time_median"]
                             for reference, variant in pairs)


def moe_vs_dense(flags, repeats, run_one, log_path_of):
    """Rows {num_experts, top_k, compute, printed, dense_tok_s, moe_tok_s, ratio} for every grid point and compute.

    run_one(label, flags) runs the trainer once and returns bench's result; log_path_of(label) is its log."""
    rows, dtype = [], flags.get("dtype", "auto")
    computes = computes_available(moe_flags(flags, *GRID[0]))
    for num_experts, top_k in GRID:
        moe, dense = moe_flags(flags, num_experts, top_k), dense_twin(moe_flags(flags, num_experts, top_k))
        runs = {name: [] for name in ("dense",) + computes}
        for repeat in range(repeats):  # dense, then each compute: back to back, so a pair shares the load
            stem = f"e{num_experts}k{top_k}-{dtype}-r{repeat + 1}"
            runs["dense"].append(run_one(f"dense-{stem}", dense))
            for compute in computes:
                runs[compute].append(run_one(f"moe-{compute}-{stem}", dict(moe, expert_compute=compute)))
        for compute in computes:
            printed = compute_printed(log_path_of(f"moe-{compute}-e{num_experts}k{top_k}-{dtype}-r1"))
            rows.append(dict(num_experts=num_experts, top_k=top_k, dtype=dtype, compute=compute, printed=printed,
                             dense_intermediate=dense["intermediate_size"],
                             dense_tok_s=statistics.median(r["tokens_per_sec_median"] for r in runs["dense"]),
                             moe_tok_s=statistics.median(r["tokens_per_sec_median"] for r in runs[compute]),
                             ratio=median_ratio(list(zip(runs["dense"], runs[compute])))))
    return rows


def ep_vs_dp(flags, repeats, run_one):
    """{dp2_tok_s, ep2_tok_s, ratio}: the MoE model on 2 processes, --ep 2 against plain dp2, alternating.

    run_one(label, flags) runs the trainer on 2 processes; ratio is median(dp2 step time / ep2 step time)."""
    moe, dtype = dict(flags, use_moe=1), flags.get("dtype", "auto")
    pairs = []
    for repeat in range(repeats):
        stem = f"e{moe.get('num_experts', 4)}k{moe.get('num_experts_per_tok', 1)}-{dtype}-r{repeat + 1}"
        pairs.append((run_one(f"dp2-{stem}", dict(moe, ep=1)), run_one(f"ep2-{stem}", dict(moe, ep=2))))
    return dict(dtype=dtype, num_experts=moe.get("num_experts", 4), top_k=moe.get("num_experts_per_tok", 1),
                dp2_tok_s=statistics.median(dp["tokens_per_sec_median"] for dp, _ in pairs),
                ep2_tok_s=statistics.median(ep["tokens_per_sec_median"] for _, ep in pairs),
                ratio=1 / median_ratio(pairs))


def moe_table(rows):
    """The --moe_vs_dense rows as a markdown table (docs/benchmarks.md)."""
    lines = ["| experts | top-k | dtype | dense width | compute (printed) | dense tok/s | MoE tok/s | MoE/dense step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['num_experts']} | {r['top_k']} | {r['dtype']} | {r['dense_intermediate']} | {r['compute']} "
              f"({r['printed']}) | {r['dense_tok_s']:.0f} | {r['moe_tok_s']:.0f} | {r['ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


def record(results_path, label, payload):
    """One summary line in the bench's results file."""
    with open(results_path, "a") as f:
        f.write(json.dumps(dict(label=label, time=time.strftime("%Y-%m-%dT%H:%M:%S"), **payload)) + "\n")


def run_moe_bench(args, flags, bench_one):
    """bench.py --moe_vs_dense / --ep_vs_dp: run the comparison, print its table, record it in --results.

    bench_one(label, flags, nproc) is bench.py's one benchmarked trainer run."""
    def log_path_of(label):  # where bench_one wrote the run's trainer output
        return os.path.join(os.path.dirname(args.results_path), f"bench_{args.label}-{label}.log")

    if args.moe_vs_dense:
        rows = moe_vs_dense(flags, args.repeats, lambda label, f: bench_one(f"{args.label}-{label}", f, 1), log_path_of)
        print(moe_table(rows), flush=True)
        record(args.results_path, f"{args.label}-moe_vs_dense", dict(rows=rows))
    if args.ep_vs_dp:
        result = ep_vs_dp(flags, args.repeats, lambda label, f: bench_one(f"{args.label}-{label}", f, 2))
        print(f"ep2 vs dp2 ({result['dtype']}, {result['num_experts']} experts, top-{result['top_k']}): "
              f"dp2 {result['dp2_tok_s']:.0f} tok/s, ep2 {result['ep2_tok_s']:.0f} tok/s, "
              f"ep2/dp2 throughput {result['ratio']:.2f}x", flush=True)
        record(args.results_path, f"{args.label}-ep_vs_dp", result)
