"""Time the trainer's DataLoader alone (no model): samples/s and tokens/s per --num_workers, against the step.

    python scripts/bench_loader.py                                     # every case, num_workers 0, 2 and 4
    python scripts/bench_loader.py --cases packed2048 sft512 --workers 0 2 --batches 100
    python scripts/bench_loader.py --step_tokens_per_s 1100            # also compare with a measured trainer rate

The loader is the trainer's own (trainer/core/loop.py:epoch_loader: DistributedSampler + SkipBatchSampler)
over the real PretrainDataset / SFTDataset and the repo tokenizer, on the demo corpus repeated --repeat_corpus
times (written once under --corpus_dir). Per case and worker count: the start-up (iter() to the first batch,
worker processes included), then --warmup batches, then --batches timed batches; then the same paced by a sleep
as long as the step on each batch, timing the wait in next(). The step it is compared with is an estimate,
not a measurement: the trainer's default model at --step_mfu of --peak_flops (an H100's dense bf16 peak by default),
tokens/s = peak * mfu / (6N + attention FLOPs per token) (trainer/observe/metrics.py).
One JSON line per case and worker count is appended to --results (default out/bench_loader.jsonl).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dataset.chat import SFTDataset  # noqa: E402
from dataset.demo_data import ensure_demo_data  # noqa: E402
from dataset.lm_dataset import PretrainDataset  # noqa: E402
from model.errors import ConfigError  # noqa: E402
from model.weights.paths import typed_or_default  # noqa: E402
from scripts.benchmarks.machine import machine_description  # noqa: E402
from trainer.base.launch import main_guard  # noqa: E402
from trainer.core.data_loading import epoch_loader  # noqa: E402
from trainer.observe.metrics import model_flops_per_token  # noqa: E402
from trainer.plan.flags import add_train_args  # noqa: E402
from trainer.plan.model_config import build_config  # noqa: E402

# name -> (demo corpus, tokens per sample, packing)
CASES = {"packed512": ("pretrain", 512, True), "packed2048": ("pretrain", 2048, True),
         "unpacked512": ("pretrain", 512, False), "sft512": ("sft", 512, False)}


def repeated_corpus(kind, times, corpus_dir):
    """The demo corpus of `kind`, or a file of it repeated `times` times (written once)."""
    source = ensure_demo_data(kind)
    if times == 1:
        return source
    path = os.path.join(corpus_dir, f"{os.path.basename(source)[:-len('.jsonl')]}.x{times}.jsonl")
    if not os.path.exists(path):
        os.makedirs(corpus_dir, exist_ok=True)
        with open(source, "rb") as f:
            text = f.read()
        with open(path + ".tmp", "wb") as f:
            f.write(text * times)
        os.replace(path + ".tmp", path)  # a reader never sees a half-written corpus
    return path


def make_dataset(case, path, tokenizer, cache_dir):
    """The dataset the trainer would build for `case` (a CASES name) from `path`."""
    kind, seq_len, packing = CASES[case]
    try:
        if kind == "sft":
            return SFTDataset(path, tokenizer, max_length=seq_len, cache_dir=cache_dir)
        return PretrainDataset(path, tokenizer, max_length=seq_len, packing=packing, cache_dir=cache_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def time_loader(dataset, batch_size, num_workers, batches, warmup, seed=42, step_seconds=0.0):
    """Iterate epoch 0's loader: start-up (to the first batch), `warmup` batches, then `batches` timed ones.

    step_seconds > 0 sleeps that long after each batch, standing in for the step it feeds (a GPU step leaves
    the CPU idle): `stall_share` is then the share of the time spent waiting for the loader."""
    loader = epoch_loader(dataset, 0, seed, batch_size, num_workers=num_workers, pin_memory=torch.cuda.is_available())
    start = time.perf_counter()
    batch_iter = iter(loader)
    next(batch_iter)
    startup = time.perf_counter() - start
    for _ in range(warmup):  # at least 2 x workers: the queue the workers prefetched is drained before timing
        next(batch_iter)
        time.sleep(step_seconds)
    samples = tokens = 0
    waited = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        before = time.perf_counter()
        input_ids, _ = next(batch_iter)
        waited += time.perf_counter() - before
        samples += input_ids.shape[0]
        tokens += input_ids.numel()
        time.sleep(step_seconds)
    seconds = time.perf_counter() - start
    del batch_iter  # stops the worker processes
    return dict(startup_s=startup, seconds=seconds, samples=samples, tokens=tokens, samples_per_s=samples / seconds,
                tokens_per_s=tokens / seconds, stall_ms_per_batch=1e3 * waited / batches, stall_share=waited / seconds)


def step_tokens_per_s(config, seq_len, peak_flops, mfu):
    """Tokens/s a training step of `config` consumes at `mfu` of `peak_flops` (an estimate: 6N + attention)."""
    return peak_flops * mfu / model_flops_per_token(config, seq_len)


def run_case(case, args, tokenizer, config):
    """Time one case for every --workers count; returns one record per count."""
    kind, seq_len, _ = CASES[case]
    corpus = repeated_corpus(kind, args.repeat_corpus, args.corpus_dir)
    dataset = make_dataset(case, corpus, tokenizer, args.cache_path)
    needed = 1 + args.warmup + args.batches
    if len(dataset) // args.batch_size < needed:
        raise ConfigError(f"{case}: {len(dataset)} samples make {len(dataset) // args.batch_size} batches of "
                          f"{args.batch_size}, fewer than the {needed} a run takes; "
                          "raise --repeat_corpus or lower --batches")
    step = step_tokens_per_s(config, seq_len, args.peak_flops, args.step_mfu)
    records = []
    for num_workers in args.workers:
        figures = time_loader(dataset, args.batch_size, num_workers, args.batches, args.warmup, args.seed)
        paced = time_loader(dataset, args.batch_size, num_workers, args.batches, args.warmup, args.seed,
                            step_seconds=args.batch_size * seq_len / step)
        record = dict(case=case, seq_len=seq_len, batch_size=args.batch_size, num_workers=num_workers,
                      rows=len(dataset), **figures, step_estimate_tokens_per_s=step,
                      loader_over_step=figures["tokens_per_s"] / step,
                      paced_stall_ms_per_batch=paced["stall_ms_per_batch"], paced_stall_share=paced["stall_share"])
        if args.step_tokens_per_s:
            record["loader_over_measured_step"] = figures["tokens_per_s"] / args.step_tokens_per_s
        records.append(record)
    return records


def print_table(records):
    measured = "loader_over_measured_step" in records[0]
    print("| case | num_workers | start-up s | samples/s | tokens/s | loader / est. step | wait per batch at "
          "est. step | wait share |" + (" loader / measured step |" if measured else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if measured else ""))
    for r in records:
        print(f"| {r['case']} | {r['num_workers']} | {r['startup_s']:.2f} | {r['samples_per_s']:,.0f} | "
              f"{r['tokens_per_s']:,.0f} | {r['loader_over_step']:.1f}x | {r['paced_stall_ms_per_batch']:.2f} ms | "
              f"{r['paced_stall_share']:.1%} |" + (f" {r['loader_over_measured_step']:,.0f}x |" if measured else ""))


def main(argv=None):
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = build_config(add_train_args(argparse.ArgumentParser()).parse_args([]))  # the trainer's default model
    machine = machine_description("cpu")
    records = [r for case in args.cases for r in run_case(case, args, tokenizer, config)]
    print_table(records)
    steps = ", ".join(f"seq {seq}: {step_tokens_per_s(config, seq, args.peak_flops, args.step_mfu):,.0f} tokens/s"
                      for seq in sorted({CASES[case][1] for case in args.cases}))
    print(f"machine: {machine}\nstep estimate (default model, {args.step_mfu:.0%} MFU of {args.peak_flops:.3g} "
          f"FLOP/s): {steps}")
    os.makedirs(os.path.dirname(args.results_path) or ".", exist_ok=True)
    with open(args.results_path, "a") as f:
        for r in records:
            f.write(json.dumps(dict(r, time=time.strftime("%Y-%m-%dT%H:%M:%S"), torch=torch.__version__,
                                    machine=machine, step_mfu=args.step_mfu, peak_flops=args.peak_flops)) + "\n")
    return records


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = parser.add_argument
    a("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="datasets and sample lengths to time")
    a("--workers", nargs="+", type=int, default=[0, 2, 4], help="DataLoader num_workers values to time")
    a("--batch_size", type=int, default=32, help="samples per batch (the trainer's --batch_size)")
    a("--batches", type=int, default=50, help="timed batches per case and worker count")
    a("--warmup", type=int, default=10, help="batches after the first, before timing (>= 2 x workers)")
    a("--repeat_corpus", type=int, default=20, help="the demo corpus repeated this many times (enough batches)")
    a("--corpus_dir", default=None, help="where the repeated corpus goes (default: out/bench_loader in the repo)")
    a("--cache_dir", default=None, help="token cache (default: dataset/.cache in the repo)")
    a("--tokenizer_path", default=None, help="Hugging Face tokenizer folder (default: model/ in the repo)")
    a("--seed", type=int, default=42, help="data order, as the trainer's --seed")
    a("--peak_flops", type=float, default=989e12, help="device peak of the step estimate (H100 dense bf16)")
    a("--step_mfu", type=float, default=0.5, help="MFU of the step estimate")
    a("--step_tokens_per_s", type=float, default=None, help="a measured trainer rate to compare with too")
    a("--results", default=None, help="JSONL the records are appended to (default: out/bench_loader.jsonl)")
    args = parser.parse_args(argv)
    for name, low in (("batch_size", 1), ("batches", 1), ("warmup", 0), ("repeat_corpus", 1)):
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    if min(args.workers) < 0:
        raise ConfigError(f"--workers must be 0 or more (got {min(args.workers)})")
    if not (args.peak_flops > 0 and 0 < args.step_mfu <= 1) or (args.step_tokens_per_s or 1) <= 0:
        raise ConfigError("--peak_flops and --step_tokens_per_s must be positive, --step_mfu in (0, 1]")
    args.corpus_dir = typed_or_default(args.corpus_dir, os.path.join("out", "bench_loader"))
    args.cache_path = typed_or_default(args.cache_dir, os.path.join("dataset", ".cache"))
    args.tokenizer = typed_or_default(args.tokenizer_path, "model")
    args.results_path = typed_or_default(args.results, os.path.join("out", "bench_loader.jsonl"))
    return args


if __name__ == "__main__":
    main_guard(main)
