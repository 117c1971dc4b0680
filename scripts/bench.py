"""Benchmark the real trainer, or print the layout model's memory and communication for a layout.

    python scripts/bench.py --steps 10 --warmup 3 --packing 1 --baseline      # fast config vs reference mode
    python scripts/bench.py --packing 1 --baseline_flags doc_mask=0 --repeats 3  # one flag's cost, side by side
    python scripts/bench.py --nproc 2 --tp 2 --steps 5                         # under torchrun
    python scripts/bench.py --plan --nproc 64 --tp 4 --pp 4 --hidden_size 2048 --num_hidden_layers 32
    python scripts/bench.py --plan --gpu 4090 --stage sft --epochs 2   # fits? how long? (scripts/planner/fit.py)
    python scripts/bench.py --moe_layer --repeats 20                          # MoE MLP vs dense, loop vs grouped
    python scripts/bench.py --moe_vs_dense --steps 3 --warmup 2 --repeats 2   # MoE vs dense trainer, 4/8 x top-1/2
    python scripts/bench.py --ep_vs_dp --steps 3 --warmup 2 --repeats 2       # --ep 2 vs dp2 on 2 processes
    python scripts/bench.py --profile --dtype bfloat16 --steps 3     # + where the step's time goes (step_profile.py)

A run launches trainer/train_pretrain.py (scripts/benchmarks/run.py; `torchrun --nproc_per_node K` when K > 1)
for warmup + steps optimizer steps with --log_interval 1 and a temporary --metrics_file, then computes
statistics over the post-warm-up step records. Flags the bench does not know go to the trainer.
One JSON line per run is appended to --results (default out/bench.jsonl).
"""
import argparse
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from scripts.planner import flags as gpu_plan  # noqa: E402 (argparse and the GPU table only)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

if __name__ == "__main__" and gpu_plan.plans_a_gpu(sys.argv[1:]):  # a bad plan flag: one line, exit 2, before torch
    gpu_plan.parse_args([a for a in sys.argv[1:] if a != "--plan"])
loading(__name__, "torch and the trainer")

import torch  # noqa: E402

from model.errors import ConfigError  # noqa: E402
from model.weights.paths import typed_or_default  # noqa: E402
from scripts.benchmarks.machine import machine_description  # noqa: E402
from scripts.benchmarks.moe import print_moe_layer_bench  # noqa: E402
from scripts.benchmarks.moe_dense import run_moe_bench  # noqa: E402
from scripts.benchmarks.run import BENCH_DEFAULTS, given_trainer_flags, run_trainer, step_stats, trainer_args  # noqa: E402
from scripts.benchmarks.step_shares import shares_line, step_shares  # noqa: E402
from scripts.planner.cost import layout_sizes, plan_layout  # noqa: E402
from scripts.planner.fit import dtype_bytes, planned_dtype, resolve_for_gpu  # noqa: E402
from scripts.planner.fit import main as fit_main  # noqa: E402
from scripts.planner.scaling import plan_table  # noqa: E402
from trainer.observe.metrics import model_flops_per_token, peak_and_status, step_flops  # noqa: E402
from trainer.plan.model_config import build_config  # noqa: E402
from trainer.plan.resolve import resolve  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

# the reference mode --baseline compares against
BASELINE_FLAGS = dict(dtype="float32", packing=0, use_compile=0, grad_checkpointing=0, loss_chunk_size=0)


# ---------------------------------------------------------------------------------------------- statistics
# ---------------------------------------------------------------------------------------------- running
def bench_one(label, flags, args, peaks, world):
    """One benchmarked trainer run: statistics, MFU against the measured peaks, one results line."""
    log_path = os.path.join(os.path.dirname(args.results_path), f"bench_{label}.log")
    start = time.time()
    run_flags = dict(flags, max_steps=args.warmup + args.steps, log_interval=1, save_interval=10 ** 9,
                     epochs=flags.get("epochs", 1000))
    profile_dir = os.path.join(os.path.dirname(args.results_path), f"profile_{label}")
    if args.profile:  # the measured steps traced; the trace is kept beside the results
        run_flags.update(profile_steps=f"{args.warmup + 1}:{args.warmup + args.steps}", save_dir=profile_dir)
    records = run_trainer(run_flags, log_path, world)
    stats = step_stats(records, args.warmup)
    if args.profile:
        trace = sorted(glob.glob(os.path.join(profile_dir, "profile", "rank0.*.pt.trace.json")))[-1]
        stats["profile"], _, seconds = step_shares(trace)
        print(f"[{label}] profile ({seconds:.3f} s per traced step, {trace}): {shares_line(stats['profile'])}")
    run = trainer_args(flags)
    config, plan = build_config(run), resolve(run, world)
    flops = model_flops_per_token(config, plan.data.seq_len)
    # counted as the trainer counts them
    step = step_flops(config, plan.data.seq_len, plan.data.global_batch * plan.data.seq_len,
                      stats["tokens_per_step"], plan.model.chunked_loss)
    stats["mfu_vs_fp32_peak"] = step / stats["step_time_median"] / (peaks["float32"] * world)
    stats["target_mfu_vs_fp32_peak"] = flops * stats["tokens_per_sec"] / (peaks["float32"] * world)  # padding excluded
    result = dict(label=label, time=time.strftime("%Y-%m-%dT%H:%M:%S"), wall_s=round(time.time() - start, 1),
                  config=flags, warmup=args.warmup, nproc=args.nproc, **stats, peak_flops=peaks,
                  torch=torch.__version__, device=flags["device"], machine=machine_description(flags["device"]))
    with open(args.results_path, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"[{label}] {stats['tokens_per_sec']:.0f} target tokens/s | step {stats['step_time_median']:.3f}s median "
          f"({stats['step_time_min']:.3f}-{stats['step_time_max']:.3f}, sd {stats['step_time_stdev']:.3f}) | "
          f"MFU {stats['mfu']:.1%} (trainer) {stats['mfu_vs_fp32_peak']:.1%} vs fp32 peak | "
          f"peak mem {stats['peak_mem_gb']:.2f} GiB | loss@{stats['final_step']} {stats['final_loss']:.4f}", flush=True)
    return result


def plan_for(flags, nproc):
    """(layout, plan_layout's estimate) for trainer `flags` on `nproc` processes, laid out as the trainer would."""
    run = trainer_args(flags)
    config = build_config(run)
    act_bytes = dtype_bytes(planned_dtype(run.dtype)[0])  # a GPU's dtype, not this CPU's --dtype auto
    t = resolve_for_gpu(run, nproc)  # the TrainPlan: the layout exactly as the trainer would run it
    lay, data = t.layout, t.data
    # the layout model knows whole-block recomputation; a selective mode is estimated as none (an upper bound)
    plan = plan_layout(config, data.seq_len, data.micro_batch, data.num_microbatches, lay, zero_stage=lay.zero_stage,
                       pp_schedule=lay.pp_schedule, act_bytes=act_bytes,
                       grad_checkpointing=t.model.grad_checkpointing == "full", sequence_parallel=lay.sequence_parallel,
                       # full logits where the trainer has them
                       loss_chunk_size=run.loss_chunk_size if t.model.chunked_loss else 0)
    layout = dict(nproc=nproc, **layout_sizes(lay), zero_stage=lay.zero_stage, pp_schedule=lay.pp_schedule,
                  act_bytes=act_bytes, micro_batch=data.micro_batch, seq_len=data.seq_len,
                  num_microbatches=data.num_microbatches)
    return layout, plan


def print_plan(args, flags):
    try:
        layout, plan = plan_for(flags, args.nproc)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    print(json.dumps(dict(layout=layout, **plan), indent=1))
    return plan


# ---------------------------------------------------------------------------------------------- main
def baseline_flags(args):
    """The flags the baseline run changes: --baseline_flags k=v,... or the reference mode."""
    if not args.baseline_flags:
        return BASELINE_FLAGS
    pairs = [item.split("=", 1) for item in args.baseline_flags.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise SystemExit(f"error: --baseline_flags {args.baseline_flags}: write name=value[,name=value]")
    return dict(pairs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # --ep is a trainer flag, not short for --ep_vs_dp
    a = parser.add_argument
    a("--steps", type=int, default=10, help="measured optimizer steps (after the warm-up)")
    a("--warmup", type=int, default=3, help="optimizer steps not measured (allocator, compile)")
    a("--nproc", type=int, default=1, help="processes (torchrun --nproc_per_node) for parallel layouts")
    a("--baseline", action="store_true", help="also run the reference mode (fp32, no packing/compile/checkpointing)")
    a("--baseline_flags", default=None, help="the baseline is the config with these trainer flags instead of the "
      "reference mode, e.g. doc_mask=0 (implies --baseline)")
    a("--plan", action="store_true", help="print the memory/communication plan of the layout; no training")
    a("--plan_table", action="store_true", help="print docs/scaling.md's tables (plan for 3 models x layouts)")
    a("--moe_layer", action="store_true", help="time the MoE MLP (loop and grouped experts) against the dense MLP at "
      "equal active parameters, forward + backward in this process, --repeats rounds (scripts/benchmarks/moe.py)")
    a("--moe_vs_dense", action="store_true", help="MoE step time over dense at equal active parameters through the "
      "trainer, 4/8 experts x top-1/2, per expert compute (loop, grouped), --repeats alternations "
      "(scripts/benchmarks/moe_dense.py)")
    a("--ep_vs_dp", action="store_true", help="the MoE model on 2 processes: --ep 2 against plain dp2 throughput, "
      "--repeats alternations")
    a("--results", default=None, help="JSONL file the results are appended to (default: out/bench.jsonl in the repo)")
    a("--label", default="run")
    a("--profile", action="store_true", help="trace the measured steps (torch.profiler) and print the shares of "
      "matmuls, casts, elementwise, attention, chunked loss, optimizer, loader (scripts/step_profile.py)")
    a("--repeats", type=int, default=1, help="alternate baseline/config runs this many times (median ratio)")
    a("--peak_fp32", type=float, default=None,
      help="fp32 peak FLOP/s for MFU (default: measured now, noisy on a busy machine)")
    args, rest = parser.parse_known_args(argv)
    flags = dict(BENCH_DEFAULTS, **given_trainer_flags(parser, rest))
    args.results_path = typed_or_default(args.results, os.path.join("out", "bench.jsonl"))
    args.baseline = args.baseline or bool(args.baseline_flags)
    return args, flags


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if gpu_plan.plans_a_gpu(argv):  # for a named or described GPU
        return fit_main([a for a in argv if a != "--plan"])
    args, flags = parse_args(argv)
    if args.plan_table:
        print(plan_table())
        return
    if args.plan:
        print_plan(args, flags)
        return
    if args.moe_layer:
        print_moe_layer_bench(flags, max(args.repeats, 5))
        return
    os.makedirs(os.path.dirname(args.results_path), exist_ok=True)
    device = flags.get("device", "cpu")
    (fp32, provisional), (bf16, _) = (peak_and_status(device, dtype) for dtype in (torch.float32, torch.bfloat16))
    peaks = {"float32": args.peak_fp32 or fp32, "bfloat16": bf16}
    print(f"machine: {machine_description(device)} | torch {torch.__version__} | measured matmul peak: "
          f"fp32 {peaks['float32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s"
          + (" (provisional: measured on busy cores, so MFU reads high)" if provisional else ""), flush=True)
    if args.moe_vs_dense or args.ep_vs_dp:
        run_moe_bench(args, flags, lambda label, f, nproc: bench_one(label, f, args, peaks, nproc))
        return
    pairs = []
    for repeat in range(args.repeats):  # alternate baseline and config: both see the same machine load
        suffix = f"-r{repeat + 1}" if args.repeats > 1 else ""
        base = bench_one(f"{args.label}-baseline{suffix}", dict(flags, **baseline_flags(args)), args, peaks,
                         args.nproc) if args.baseline else None
        pairs.append((base, bench_one(args.label + suffix, flags, args, peaks, args.nproc)))
    if args.baseline:
        ratios = [fast["tokens_per_sec_median"] / base["tokens_per_sec_median"] for base, fast in pairs]
        ratio = statistics.median(ratios)
        print(f"speed-up vs baseline: {ratio:.2f}x target tokens/s (median-step basis; per repeat: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); peak mem {pairs[-1][1]['peak_mem_gb']:.2f} vs "
              f"{pairs[-1][0]['peak_mem_gb']:.2f} GiB")
        with open(args.results_path, "a") as f:
            f.write(json.dumps(dict(label=f"{args.label}-ratio", speedup_target_tokens_per_sec=ratio, per_repeat=ratios,
                                    time=time.strftime("%Y-%m-%dT%H:%M:%S"))) + "\n")

if __name__ == "__main__":
    main()
