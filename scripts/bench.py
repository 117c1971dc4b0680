"""Benchmark the real trainer, or plan a parallel layout's memory and communication.

    python scripts/bench.py --steps 10 --warmup 3 --packing 1 --baseline      # fast config vs reference mode
    python scripts/bench.py --nproc 2 --tp 2 --steps 5                         # under torchrun
    python scripts/bench.py --plan --nproc 64 --tp 4 --pp 4 --hidden_size 2048 --num_hidden_layers 32

A run launches trainer/train_pretrain.py (under `torchrun --nproc_per_node K` when K > 1) for
warmup + steps optimizer steps with --log_interval 1 and a temporary --metrics_file, then computes
statistics over the post-warm-up step records. Flags the bench does not know go to the trainer.
One JSON line per run is appended to --results (default out/bench.jsonl).
"""
import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig  # noqa: E402
from trainer.checks import data_parallel_mode  # noqa: E402
from trainer.config import resolve  # noqa: E402
from trainer.flags import add_train_args  # noqa: E402
from trainer.model_config import build_config  # noqa: E402
from trainer.metrics import model_flops_per_token, peak_flops, step_flops  # noqa: E402
from trainer.launch import ConfigError  # noqa: E402
from trainer.trainer_utils import ROOT, typed_or_default  # noqa: E402

TRAIN_SCRIPT = os.path.join(ROOT, "trainer", "train_pretrain.py")
# the benchmark's default model: MiniMind's small config
BENCH_DEFAULTS = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_seq_len=256, batch_size=8, accumulation_steps=1,
                      device="cuda:0" if torch.cuda.is_available() else "cpu")
# the reference mode --baseline compares against
BASELINE_FLAGS = dict(dtype="float32", packing=0, use_compile=0, grad_checkpointing=0, loss_chunk_size=0)


# ---------------------------------------------------------------------------------------------- statistics
def step_stats(records, warmup):
    """Figures over the step records after `warmup` steps (trainer metrics with --log_interval 1).

    A step's time is its target tokens / its tokens_per_sec (the trainer's own window for that step).
    """
    steps = sorted((r for r in records if "tokens_per_sec" in r), key=lambda r: r["step"])
    prev_tokens = {s["step"]: p["tokens"] for p, s in zip(steps, steps[1:])}
    measured = [r for r in steps if r["step"] > warmup and r["step"] in prev_tokens]
    if not measured:
        raise ValueError(f"no step records after {warmup} warm-up steps")
    tokens = [r["tokens"] - prev_tokens[r["step"]] for r in measured]
    times = [t / r["tokens_per_sec"] for t, r in zip(tokens, measured)]
    total_time = sum(times)
    return dict(
        steps=len(measured), tokens_per_sec=sum(tokens) / total_time,
        step_time_median=statistics.median(times), step_time_min=min(times), step_time_max=max(times),
        step_time_stdev=statistics.stdev(times) if len(times) > 1 else 0.0,
        mfu=sum(r["mfu"] * t for r, t in zip(measured, times)) / total_time,  # time-weighted, as the trainer defines it
        peak_mem_gb=max(r["peak_mem_gb"] for r in steps),
        final_step=steps[-1]["step"], final_loss=steps[-1]["loss"],
        final_loss_mean10=statistics.mean(r["loss"] for r in steps[-10:]),  # one step's batch is noisy
        tokens_per_step=sum(tokens) / len(tokens),
        tokens_per_sec_median=statistics.median(tokens) / statistics.median(times))  # robust to load spikes


def machine_description(device):
    """CPU model, cores, load and memory (plus the GPU name on CUDA), in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [cpu, f"{os.cpu_count()} cores", f"torch threads {torch.get_num_threads()}"]
    if hasattr(os, "getloadavg"):
        parts.append("load %.1f/%.1f/%.1f" % os.getloadavg())
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        parts.append(f"{pages * page_size / 2**30:.0f} GiB RAM")
    except (ValueError, OSError):
        pass
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name(device))
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- running
def trainer_command(flags, nproc):
    """argv for one trainer run with `flags` (a dict of trainer flag -> value); torchrun when nproc > 1."""
    argv = []
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]  # True: store_true flags
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return launcher + [TRAIN_SCRIPT] + argv


def run_trainer(flags, warmup, steps, nproc, log_path):
    """Run the trainer for warmup + steps steps in a temp dir; returns its metrics records."""
    tmp = tempfile.mkdtemp(prefix="bench_")
    try:
        metrics = os.path.join(tmp, "metrics.jsonl")
        flags = dict(flags, max_steps=warmup + steps, log_interval=1, save_interval=10 ** 9, epochs=flags.get("epochs", 1000),
                     metrics_file=metrics, save_dir=os.path.join(tmp, "out"), checkpoint_dir=os.path.join(tmp, "ckpt"))
        argv = trainer_command(flags, nproc)
        with open(log_path, "w") as log:
            log.write(" ".join(argv) + "\n")
            log.flush()
            proc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"trainer exited with {proc.returncode}; log {log_path}:\n{tail}")
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_one(label, flags, args, peaks, world):
    """One benchmarked trainer run: statistics, MFU against the measured peaks, one results line."""
    log_path = os.path.join(os.path.dirname(args.results_path), f"bench_{label}.log")
    start = time.time()
    records = run_trainer(flags, args.warmup, args.steps, args.nproc, log_path)
    stats = step_stats(records, args.warmup)
    run = trainer_args(flags)
    config, plan = build_config(run), resolve(run, world)
    flops = model_flops_per_token(config, plan.seq_len)
    # counted as the trainer counts them
    step = step_flops(config, plan.seq_len, plan.global_batch * plan.seq_len, stats["tokens_per_step"], plan.chunked_loss)
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
          f"peak mem {stats['peak_mem_gb']:.2f} GB | loss@{stats['final_step']} {stats['final_loss']:.4f}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------- plan
def plan_layout(config, seq_len, micro_batch, num_microbatches, dp=1, tp=1, pp=1, cp=1, zero_stage=0,
                pp_schedule="1f1b", act_bytes=4, grad_checkpointing=False, sequence_parallel=False, loss_chunk_size=0):
    """Memory per rank and communication per optimizer step for one layout (formulas: docs/scaling.md).

    Bytes throughout. fp32 master weights, fp32 grads and two fp32 AdamW moments (what the trainer keeps);
    act_bytes = bytes per activation element (4 fp32, 2 under bf16 autocast). Ring collectives:
    an all-reduce moves 2(n-1)/n of the buffer per rank, reduce-scatter and all-gather (n-1)/n.
    """
    h, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    q_dim, kv_dim = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    experts = config.num_experts if config.use_moe else 1
    layer_params = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * I * experts + 2 * h + 2 * config.head_dim
    embed_params = V * h
    total_params = L * layer_params + embed_params + h  # tied lm_head counted once
    # worst pipeline stage: L/pp layers + one vocab matrix (first stage embeds, last stage projects)
    stage_params = math.ceil(L / pp) * layer_params + embed_params
    params_rank = stage_params / tp
    shard = dp * cp  # the data-parallel group (cp ranks hold the same weights)
    weight_bytes = 4 * params_rank / (shard if zero_stage >= 3 else 1)
    grad_bytes = 4 * params_rank / (shard if zero_stage >= 2 else 1)
    optim_bytes = 8 * params_rank / (shard if zero_stage >= 1 else 1)

    tokens = micro_batch * seq_len / cp  # tokens of one micro-batch on one rank
    # saved activations per token per layer (measured on MiniMindBlock, within 1%): 12h + 2 kv + 4 I
    # elements, the 4h of norm inputs/outputs stay replicated under tp unless sequence parallel
    replicated = 4 * h
    sharded = 8 * h + 2 * kv_dim + 4 * I * (config.num_experts_per_tok if config.use_moe else 1)
    per_token_layer = (replicated / (tp if sequence_parallel else 1) + sharded / tp) * act_bytes
    layers_rank = math.ceil(L / pp)
    if grad_checkpointing:  # keep each block's input, recompute one block at a time in backward
        act_microbatch = tokens * (layers_rank * h * act_bytes + per_token_layer)
    else:
        act_microbatch = tokens * layers_rank * per_token_layer
    # fp32 logits + their gradient, over the whole micro-batch or one chunk
    logit_rows = min(tokens, loss_chunk_size) if loss_chunk_size else tokens
    logits_bytes = 2 * 4 * logit_rows * V / tp
    virtual = 2 if pp_schedule == "interleaved1f1b" else 1
    in_flight = 1 if pp == 1 else (num_microbatches if pp_schedule == "gpipe" else min(num_microbatches, pp))
    act_bytes_rank = in_flight * act_microbatch + logits_bytes

    comm = {}
    grad_buffer = 4 * params_rank
    if shard > 1:
        ring = (shard - 1) / shard
        if zero_stage <= 1:
            comm["dp_allreduce"] = 2 * ring * grad_buffer
        else:
            comm["dp_reduce_scatter"] = ring * grad_buffer
            # ZeRO-2 gathers weights once per step, ZeRO-3 in forward and again in backward
            comm["dp_allgather"] = ring * grad_buffer * (2 if zero_stage >= 3 else 1)
    m = num_microbatches
    if tp > 1:  # 2 all-reduces forward (attention and MLP outputs) + 2 backward per layer per micro-batch
        comm["tp_allreduces_per_layer"] = 4
        comm["tp_allreduce"] = 4 * layers_rank * m * 2 * (tp - 1) / tp * tokens * h * act_bytes
    if pp > 1:  # each micro-batch sends its hidden state forward and its gradient backward per boundary
        comm["pp_p2p"] = 2 * m * tokens * h * act_bytes * virtual
    if cp > 1:  # ring attention: K and V pass cp-1 hops forward; backward passes K, V and dK, dV
        kv_block = 2 * tokens * kv_dim * act_bytes
        comm["cp_kv_ring"] = 3 * (cp - 1) * kv_block * layers_rank * m
    bubble = (pp - 1) / (virtual * m + pp - 1) if pp > 1 else 0.0
    return dict(total_params=total_params, params_per_rank=params_rank,
                memory_gb=dict(weights=weight_bytes / 2**30, grads=grad_bytes / 2**30, optimizer=optim_bytes / 2**30,
                               activations_per_microbatch=act_microbatch / 2**30, logits=logits_bytes / 2**30,
                               microbatches_in_flight=in_flight, activations=act_bytes_rank / 2**30,
                               total=(weight_bytes + grad_bytes + optim_bytes + act_bytes_rank) / 2**30),
                comm_gb_per_step={k: (v / 2**30 if not k.endswith("_per_layer") else v) for k, v in comm.items()},
                bubble_fraction=bubble)


# configurations of docs/scaling.md: name -> (model flags, seq_len, micro_batch, micro-batches)
SCALING_MODELS = {
    "MiniMind default (h768, 8 layers)": (dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                                               num_key_value_heads=4), 512, 16, 8),
    "500M (h1536, 20 layers)": (dict(hidden_size=1536, num_hidden_layers=20, num_attention_heads=12,
                                     num_key_value_heads=4), 2048, 4, 16),
    "1.5B (h2048, 32 layers)": (dict(hidden_size=2048, num_hidden_layers=32, num_attention_heads=16,
                                     num_key_value_heads=4), 2048, 2, 32),
}
SCALING_LAYOUTS = {8: [dict(), dict(zero_stage=2), dict(tp=2), dict(tp=2, pp=2), dict(cp=2, zero_stage=2)],
                   64: [dict(zero_stage=2), dict(tp=4), dict(tp=2, pp=4), dict(tp=4, pp=2, pp_schedule="interleaved1f1b"),
                        dict(tp=2, pp=2, cp=2)]}


def plan_table():
    """docs/scaling.md's tables: plan_layout for SCALING_MODELS x SCALING_LAYOUTS (bf16 activations)."""
    lines = []
    for name, (model, seq_len, micro_batch, micro_batches) in SCALING_MODELS.items():
        config = MiniMindConfig(**model)
        lines += [f"\n### {name}: {plan_layout(config, seq_len, micro_batch, 1)['total_params'] / 1e6:.0f}M params, "
                  f"seq {seq_len}, micro-batch {micro_batch}, {micro_batches} micro-batches per step per dp rank\n",
                  "| GPUs | layout | weights+grads+Adam GB | activations GB | total GB/rank | dp GB | tp GB | pp GB | cp GB | bubble |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for gpus, layouts in SCALING_LAYOUTS.items():
            for layout in layouts:
                tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
                dp, zero, _ = data_parallel_mode(gpus, tp, pp, cp, layout.get("zero_stage", 0))  # as the trainer runs it
                schedule = layout.get("pp_schedule", "1f1b")
                plan = plan_layout(config, seq_len, micro_batch, micro_batches, dp, tp, pp, cp, zero, schedule, act_bytes=2)
                mem, comm = plan["memory_gb"], plan["comm_gb_per_step"]
                dp_gb = sum(v for k, v in comm.items() if k.startswith("dp_"))
                desc = f"dp{dp} tp{tp} pp{pp} cp{cp} zero{zero}" + (" interleaved" if schedule != "1f1b" else "")
                lines.append(f"| {gpus} | {desc} | {mem['weights'] + mem['grads'] + mem['optimizer']:.2f} | "
                             f"{mem['activations']:.2f} | {mem['total']:.2f} | {dp_gb:.2f} | {comm.get('tp_allreduce', 0):.2f} | "
                             f"{comm.get('pp_p2p', 0):.2f} | {comm.get('cp_kv_ring', 0):.2f} | {plan['bubble_fraction']:.1%} |")
    return "\n".join(lines)


def print_plan(args, flags):
    run = trainer_args(flags)
    config = build_config(run)
    try:
        t = resolve(run, args.nproc)  # the TrainPlan: the layout exactly as the trainer would run it
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    act_bytes = 4 if t.dtype == torch.float32 else 2
    plan = plan_layout(config, t.seq_len, t.micro_batch, t.num_microbatches, t.dp, t.tp, t.pp, t.cp, t.zero_stage,
                       t.pp_schedule, act_bytes, t.grad_checkpointing, t.sequence_parallel,
                       run.loss_chunk_size if t.chunked_loss else 0)  # full logits where the trainer has them
    print(json.dumps(dict(layout=dict(nproc=args.nproc, dp=t.dp, tp=t.tp, pp=t.pp, cp=t.cp, zero_stage=t.zero_stage,
                                      pp_schedule=t.pp_schedule, act_bytes=act_bytes, micro_batch=t.micro_batch,
                                      seq_len=t.seq_len, num_microbatches=t.num_microbatches), **plan), indent=1))
    return plan


# ---------------------------------------------------------------------------------------------- main
def trainer_args(flags):
    """The trainer's argument namespace for `flags` (a dict of trainer flags), its defaults for the rest."""
    args = add_train_args(argparse.ArgumentParser()).parse_args([])  # the trainer's own defaults
    vars(args).update(flags)
    return args


def given_trainer_flags(parser, rest):
    """The trainer flags among `rest` (only those given, as a dict); anything else is a usage error."""
    trainer = add_train_args(argparse.ArgumentParser())
    for action in trainer._actions:
        action.default = argparse.SUPPRESS  # keep only the trainer flags given on the command line
    given, unknown = trainer.parse_known_args(rest)
    if unknown:
        parser.error(f"unknown flags (neither {parser.prog} nor trainer): {' '.join(unknown)}")
    return vars(given)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parser.add_argument
    a("--steps", type=int, default=10, help="measured optimizer steps (after the warm-up)")
    a("--warmup", type=int, default=3, help="optimizer steps not measured (allocator, compile)")
    a("--nproc", type=int, default=1, help="processes (torchrun --nproc_per_node) for parallel layouts")
    a("--baseline", action="store_true", help="also run the reference mode (fp32, no packing/compile/checkpointing)")
    a("--plan", action="store_true", help="print the memory/communication plan of the layout; no training")
    a("--plan_table", action="store_true", help="print docs/scaling.md's tables (plan for 3 models x layouts)")
    a("--results", default=None, help="JSONL file the results are appended to (default: out/bench.jsonl in the repo)")
    a("--label", default="run")
    a("--repeats", type=int, default=1, help="alternate baseline/config runs this many times (median ratio)")
    a("--peak_fp32", type=float, default=None, help="fp32 peak FLOP/s for MFU (default: measured now, noisy on a busy machine)")
    args, rest = parser.parse_known_args(argv)
    flags = dict(BENCH_DEFAULTS, **given_trainer_flags(parser, rest))
    args.results_path = typed_or_default(args.results, os.path.join("out", "bench.jsonl"))
    return args, flags


def main(argv=None):
    args, flags = parse_args(argv)
    if args.plan_table:
        print(plan_table())
        return
    if args.plan:
        print_plan(args, flags)
        return
    os.makedirs(os.path.dirname(args.results_path), exist_ok=True)
    device = flags.get("device", "cpu")
    peaks = {"float32": args.peak_fp32 or peak_flops(device, torch.float32), "bfloat16": peak_flops(device, torch.bfloat16)}
    print(f"machine: {machine_description(device)} | torch {torch.__version__} | measured matmul peak: "
          f"fp32 {peaks['float32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s", flush=True)
    pairs = []
    for repeat in range(args.repeats):  # alternate baseline and config: both see the same machine load
        suffix = f"-r{repeat + 1}" if args.repeats > 1 else ""
        base = bench_one(f"{args.label}-baseline{suffix}", dict(flags, **BASELINE_FLAGS), args, peaks, args.nproc) \
            if args.baseline else None
        pairs.append((base, bench_one(args.label + suffix, flags, args, peaks, args.nproc)))
    if args.baseline:
        ratios = [fast["tokens_per_sec_median"] / base["tokens_per_sec_median"] for base, fast in pairs]
        ratio = statistics.median(ratios)
        print(f"speed-up vs baseline: {ratio:.2f}x target tokens/s (median-step basis; per repeat: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); peak mem {pairs[-1][1]['peak_mem_gb']:.2f} vs "
              f"{pairs[-1][0]['peak_mem_gb']:.2f} GB")
        with open(args.results_path, "a") as f:
            f.write(json.dumps(dict(label=f"{args.label}-ratio", speedup_target_tokens_per_sec=ratio, per_repeat=ratios,
                                    time=time.strftime("%Y-%m-%dT%H:%M:%S"))) + "\n")

if __name__ == "__main__":
    main()
