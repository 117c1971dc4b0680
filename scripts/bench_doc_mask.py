"""What --doc_mask costs: forward+backward time of one packed micro-batch with and without the document mask.

    python scripts/bench_doc_mask.py --max_seq_len 256 --batch_size 8 --rounds 6 [--dtype bf16] [--use_moe 1]

Same model, same real packed rows of the demo corpus (dataset/lm_dataset.py), the two variants
interleaved round by round so a shared machine's load hits both alike; prints the median seconds of
each and their ratio. "plain" swaps the model's document_mask hook for none (as context parallel swaps
it), so attention runs SDPA's plain causal kernel. Model: bench.py's small config (h512, 8 layers,
8 heads, 2 KV heads); fp32 weights, --dtype bf16 runs under CPU autocast as training does.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402
from dataset.lm_dataset import PretrainDataset  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, packed_document_mask  # noqa: E402
from model.weights.paths import ROOT  # noqa: E402


def no_mask(position_ids):
    return None


def step_seconds(model, input_ids, labels, position_ids, dtype):
    model.model.document_mask = packed_document_mask if position_ids is not None else no_mask
    start = time.perf_counter()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    with autocast:
        loss = model(input_ids, position_ids=position_ids, labels=labels).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of each variant (after one warm-up)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: CPU autocast")
    parser.add_argument("--use_moe", type=int, default=0, choices=[0, 1], help="4 experts, top-1 (minimind-3's MoE)")
    args = parser.parse_args()
    if min(args.max_seq_len, args.batch_size, args.rounds) < 1:
        parser.exit(2, "error: --max_seq_len, --batch_size and --rounds must be positive\n")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    dataset = PretrainDataset(ensure_demo_data("pretrain"), tokenizer, max_length=args.max_seq_len, packing=True,
                              doc_mask=True)
    rows = [dataset[i] for i in range(args.batch_size)]
    input_ids, labels, positions = (torch.stack(column) for column in zip(*rows))
    documents = int((positions == 0).sum())
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                               num_key_value_heads=2, vocab_size=len(tokenizer),
                                               use_moe=bool(args.use_moe)))
    times = {"masked": [], "plain": []}
    for round_ in range(args.rounds + 1):
        for name, position_ids in (("masked", positions), ("plain", None)):
            seconds = step_seconds(model, input_ids, labels, position_ids, args.dtype)
            if round_:  # round 0 warms up both
                times[name].append(seconds)
    masked, plain = (statistics.median(times[name]) for name in ("masked", "plain"))
    tokens = input_ids.numel()
    print(f"batch {args.batch_size} x seq {args.max_seq_len}, {documents} document starts in {args.batch_size} rows, "
          f"{args.dtype}, moe {args.use_moe}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"masked {masked:.3f} s ({tokens / masked:.0f} tokens/s) | plain causal {plain:.3f} s "
          f"({tokens / plain:.0f} tokens/s) | masked/plain time {masked / plain:.3f}")


if __name__ == "__main__":
    main()
