"""The project against TRL (DPOTrainer, SFTTrainer, GRPOTrainer) on the same exported model, the same rows in the same
order, micro-batch, sequence length, dtype, optimizer (fused AdamW) and reference handling (DPO: precomputed in
both), run alternately (ours then TRL, then TRL then ours, ...): target tokens/s, steps/s and peak memory of each,
the ratio of medians, and both step-1 losses (asserted equal within rounding).

    pip install -r requirements-bench.txt        # TRL: a benchmark requirement, never a runtime one
    python scripts/bench_peers.py --stages dpo,sft,grpo --dtypes float32,bfloat16 --rounds 2

Both sides run as their own processes with this interpreter; the load average is printed before and after each run.
One JSON line per stage and dtype is appended to --results (default out/bench_peers.jsonl).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch and the trainer")

from transformers import AutoTokenizer  # noqa: E402

from model.weights.paths import ROOT, typed_or_default  # noqa: E402
from scripts.benchmarks.machine import machine_description  # noqa: E402
from scripts.benchmarks.peers import REWARD, dpo_rows, export_model, grpo_rows, ours_run, sft_rows, trl_run  # noqa: E402

loaded()


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def stage_setup(stage, args, work, folder, tokenizer):
    """(the project's trainer flags, TRL's spec) of `stage`, less the dtype."""
    steps = args.warmup + args.steps
    model = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                 num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads)
    flags = dict(model, from_weight=folder, max_seq_len=args.seq_len, batch_size=args.micro_batch,
                 accumulation_steps=1, learning_rate=args.learning_rate, warmup_steps=0, lr_schedule="cosine",
                 max_steps=steps, epochs=1000, log_interval=1, save_interval=10 ** 9, seed=42, device="cpu",
                 cache_dir=os.path.join(work, "cache"))
    spec = dict(stage=stage, model=folder, micro_batch=args.micro_batch, accumulation_steps=1, max_steps=steps,
                learning_rate=args.learning_rate, seed=42, seq_len=args.seq_len, beta=args.beta)
    if stage == "dpo":
        path, rows = dpo_rows(work, tokenizer, steps * args.micro_batch, args.seq_len)
        flags.update(beta=args.beta)
    elif stage == "sft":
        path, rows = sft_rows(work, tokenizer, args.sft_conversations, args.seq_len)
        flags.update(packing=1)
    else:
        path, rows = grpo_rows(work, steps * args.micro_batch)
        reward_file = os.path.join(work, "peer_reward.py")
        with open(reward_file, "w") as f:
            f.write(REWARD)
        flags.update(max_seq_len=args.prompt_len, max_gen_len=args.gen_len, num_generations=args.num_generations,
                     loss_type="grpo", beta=0.0, temperature=1.0, top_p=1.0, thinking_ratio=0.0, reward="none",
                     reward_fn=f"{reward_file}:reward")
        spec.update(num_generations=args.num_generations, max_gen_len=args.gen_len, reward_file=reward_file)
    return dict(flags, data_path=path), dict(spec, rows=rows)


def same_first_loss(stage, dtype, ours, trl):
    """Both step-1 losses within rounding. SFT: the same CE over the same tokens from the same weights, in another
    kernel order: fp32 1e-5 relative (bf16: autocast's rounding, 2e-2). DPO (ln 2) and GRPO (0): the policy is the
    reference and the advantages sum to 0 per group, up to fp32 rounding of sums of ~100 terms: 1e-5 absolute (bf16:
    the reference pass and the step's forward round alike but in other batches, 2e-3)."""
    a, b = ours["losses"][0], trl["losses"][0]
    relative = stage == "sft"
    tolerance = {("float32", True): 1e-5, ("bfloat16", True): 2e-2, ("float32", False): 1e-5,
                 ("bfloat16", False): 2e-3}[dtype, relative]
    if not math.isclose(a, b, rel_tol=tolerance if relative else 0.0, abs_tol=0.0 if relative else tolerance):
        raise SystemExit(f"error: {stage} {dtype}: step-1 losses differ: ours {a:.6f}, TRL {b:.6f}")


def one_run(side, stage, dtype, flags, spec, work, args, rnd):
    before, start = load(), time.time()
    log_path = os.path.join(work, f"{stage}_{dtype}_{side}_{rnd}.log")
    if side == "ours":
        result = ours_run(stage, dict(flags, dtype=dtype), tempfile.mkdtemp(prefix=f"ours_{stage}_", dir=work),
                          log_path, args.warmup)
    else:
        run_work = tempfile.mkdtemp(prefix=f"trl_{stage}_", dir=work)
        result = trl_run(dict(spec, dtype=dtype, work=run_work, out=os.path.join(run_work, "result.json")), log_path,
                         args.warmup)
    result.update(load_before=before, load_after=load(), wall_s=round(time.time() - start, 1))
    print(f"  [{stage} {dtype} {side} r{rnd}] {result['tokens_per_sec']:.0f} target tokens/s "
          f"({result['tokens_per_cpu_sec']:.0f} per CPU-s), {result['steps_per_sec']:.2f} steps/s, "
          f"peak {result['peak_mem_gb']:.2f} GiB, step-1 loss "
          f"{result['losses'][0]:.6f} | load {before} -> {result['load_after']}", flush=True)
    return result


def compare(stage, dtype, flags, spec, work, args):
    """Rounds of both sides, alternately; the ratio of medians; one results line."""
    runs = {"ours": [], "trl": []}
    for rnd in range(1, args.rounds + 1):
        for side in (("ours", "trl") if rnd % 2 else ("trl", "ours")):
            runs[side].append(one_run(side, stage, dtype, flags, spec, work, args, rnd))
        same_first_loss(stage, dtype, runs["ours"][-1], runs["trl"][-1])
    keys = ("tokens_per_sec", "tokens_per_cpu_sec", "steps_per_sec", "peak_mem_gb")
    median = {side: {key: statistics.median(r[key] for r in rs) for key in keys} for side, rs in runs.items()}
    ratio = median["ours"]["tokens_per_sec"] / median["trl"]["tokens_per_sec"]
    cpu_ratio = median["ours"]["tokens_per_cpu_sec"] / median["trl"]["tokens_per_cpu_sec"]
    print(f"{stage} {dtype}: ours {median['ours']['tokens_per_sec']:.0f} vs TRL {median['trl']['tokens_per_sec']:.0f} "
          f"target tokens/s = {ratio:.2f}x (per CPU-second {cpu_ratio:.2f}x; steps/s "
          f"{median['ours']['steps_per_sec']:.2f} vs "
          f"{median['trl']['steps_per_sec']:.2f}; peak {median['ours']['peak_mem_gb']:.2f} vs "
          f"{median['trl']['peak_mem_gb']:.2f} GiB); step-1 loss ours {runs['ours'][0]['losses'][0]:.6f}, TRL "
          f"{runs['trl'][0]['losses'][0]:.6f}", flush=True)
    return dict(stage=stage, dtype=dtype, ratio_tokens_per_sec=ratio, ratio_tokens_per_cpu_sec=cpu_ratio,
                medians=median, runs=runs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parser.add_argument
    a("--stages", default="dpo,sft,grpo")
    a("--dtypes", default="float32,bfloat16")
    a("--rounds", type=int, default=2, help="alternations of the two sides per stage and dtype")
    a("--steps", type=int, default=40, help="measured optimizer steps (after the warm-up); DPO's steps are ~50 ms, and "
      "12 of them (0.6 s) moved the median by 10%% between rounds")
    a("--warmup", type=int, default=2)
    a("--hidden_size", type=int, default=256)
    a("--num_hidden_layers", type=int, default=4)
    a("--num_attention_heads", type=int, default=4)
    a("--num_key_value_heads", type=int, default=2)
    a("--seq_len", type=int, default=256, help="DPO and SFT rows (--max_seq_len / TRL's max_length)")
    a("--micro_batch", type=int, default=2, help="pairs (DPO), packed rows (SFT), prompts (GRPO) per step")
    a("--learning_rate", type=float, default=1e-4)
    a("--beta", type=float, default=0.1, help="DPO's beta (TRL's default)")
    a("--sft_conversations", type=int, default=400, help="demo conversations packed into SFT's rows")
    a("--prompt_len", type=int, default=64, help="GRPO: prompt tokens at most")
    a("--gen_len", type=int, default=32, help="GRPO: new tokens per completion at most")
    a("--num_generations", type=int, default=4)
    a("--threads", type=int, default=None, help="OMP_NUM_THREADS of both sides' processes (default: torch's own, one "
      "per core); 1 keeps a heavily loaded machine's figures steadier")
    a("--results", default=None, help="JSONL file the results are appended to (default: out/bench_peers.jsonl)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    results_path = typed_or_default(args.results, os.path.join("out", "bench_peers.jsonl"))
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children's: both sides alike
    print(f"machine: {machine_description('cpu')}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}",
          flush=True)
    work = tempfile.mkdtemp(prefix="bench_peers_")
    model = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                 num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads)
    folder = export_model(work, model)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    for stage in args.stages.split(","):
        flags, spec = stage_setup(stage, args, work, folder, tokenizer)
        for dtype in args.dtypes.split(","):
            result = compare(stage, dtype, flags, spec, work, args)
            with open(results_path, "a") as f:
                f.write(json.dumps(dict(result, time=time.strftime("%Y-%m-%dT%H:%M:%S"), config=vars(args),
                                        machine=machine_description("cpu"))) + "\n")
    print(f"logs and rows in {work}")


if __name__ == "__main__":
    main()
