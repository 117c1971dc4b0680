"""Does the fast configuration learn as well as the reference mode? Train both, score both the same way.

    python scripts/quality.py --steps 200                                    # bench's small config
    python scripts/quality.py --steps 30 --hidden_size 128 --num_hidden_layers 2   # a quick look

The embedded pretraining corpus is split: the last --heldout documents are never trained on. Four
runs of the real trainer/train_pretrain.py, fp32, same seed, same training documents:
  baseline   --packing 0 --loss_chunk_size 0      pad to max_seq_len, full logits (bench's reference)
  fast-same  --packing 0 --loss_chunk_size 1024   the fast numerics on the baseline's very batches
  fast       --packing 1 --loss_chunk_size 1024   the fast configuration (bench's default; --doc_mask 1)
  fast-no-doc-mask   the same with --doc_mask 0: documents in a packed row attend to each other
Each run's final weights are scored on the held-out documents one per row, padded, mean CE per
target token: the same measure for every run, whatever its batches looked like. `fast-same` vs
`baseline` compares the training loss at the last step too (same batches, so it must agree);
`fast` sees ~3x more target tokens per step than the padded runs, so only the held-out loss is
like for like there. One JSON line per run goes to --results. Flags the script does not know go to
the trainer.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402
from dataset.lm_dataset import PretrainDataset  # noqa: E402
from scripts.bench import BENCH_DEFAULTS, given_trainer_flags, trainer_args, trainer_command  # noqa: E402
from trainer.model_config import build_config  # noqa: E402
from trainer.train_loop import step_targets  # noqa: E402
from trainer.trainer_utils import ROOT, init_model, typed_or_default, weight_name  # noqa: E402

RUNS = {"baseline": dict(packing=0, loss_chunk_size=0),
        "fast-same": dict(packing=0, loss_chunk_size=1024),
        "fast": dict(packing=1, loss_chunk_size=1024, doc_mask=1),
        "fast-no-doc-mask": dict(packing=1, loss_chunk_size=1024, doc_mask=0)}


def split_corpus(tmp, heldout):
    """(train path, held-out path): the demo corpus without / with only its last `heldout` lines."""
    with open(ensure_demo_data("pretrain")) as f:
        lines = f.readlines()
    paths = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "heldout.jsonl")
    for path, part in zip(paths, (lines[:-heldout], lines[-heldout:])):
        with open(path, "w") as f:
            f.writelines(part)
    return paths


def heldout_loss(config, save_dir, path, seq_len, tmp):
    """Mean CE per target token of the pretrain weights in `save_dir` over the documents of `path`, one per row."""
    model = init_model(config, os.path.join(save_dir, weight_name("pretrain", config) + ".pth"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    dataset = PretrainDataset(path, tokenizer, max_length=seq_len, packing=False, cache_dir=tmp)
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for input_ids, labels in DataLoader(dataset, batch_size=16):
            targets = step_targets(labels)
            n = int((targets != -100).sum())
            out = model(input_ids, shift_labels=targets, num_items_in_batch=n)
            total, count = total + out.loss.item() * n, count + n
    return total / count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=300, help="documents kept out of training")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--results", default=None, help="JSONL the rows are appended to (default: out/quality.jsonl in the repo)")
    args, rest = parser.parse_known_args()
    flags = dict(BENCH_DEFAULTS, dtype="float32", seed=42, **given_trainer_flags(parser, rest))
    config = build_config(trainer_args(flags))
    tmp = tempfile.mkdtemp(prefix="quality_")
    results = typed_or_default(args.results, os.path.join("out", "quality.jsonl"))
    os.makedirs(os.path.dirname(results), exist_ok=True)
    try:
        train_path, heldout_path = split_corpus(tmp, args.heldout)
        rows = {}
        for name in args.runs.split(","):
            work = os.path.join(tmp, name)
            run_flags = dict(flags, **RUNS[name], data_path=train_path, max_steps=args.steps, log_interval=1,
                             save_interval=10 ** 9, save_dtype="float32", metrics_file=os.path.join(work, "m.jsonl"),
                             save_dir=os.path.join(work, "out"), checkpoint_dir=os.path.join(work, "ckpt"))
            with open(os.path.join(tmp, f"{name}.log"), "w") as log:
                proc = subprocess.run(trainer_command(run_flags, 1), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                sys.exit(f"error: the {name} run failed; log {os.path.join(tmp, name + '.log')}")
            with open(run_flags["metrics_file"]) as f:
                steps = [r for r in map(json.loads, f) if "step" in r and "loss" in r]
            row = dict(run=name, steps=args.steps, train_loss=steps[-1]["loss"],
                       train_loss_last10=sum(r["loss"] for r in steps[-10:]) / len(steps[-10:]),
                       target_tokens=steps[-1]["tokens"],
                       heldout_loss=heldout_loss(config, run_flags["save_dir"], heldout_path, flags["max_seq_len"], tmp),
                       flags={k: v for k, v in run_flags.items() if k not in ("metrics_file", "save_dir", "checkpoint_dir", "data_path")},
                       torch=torch.__version__)
            rows[name] = row
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name:10s} step {args.steps}: train loss {row['train_loss']:.4f} (last 10: {row['train_loss_last10']:.4f}), "
                  f"held-out loss {row['heldout_loss']:.4f}, target tokens seen {row['target_tokens']}", flush=True)
        base = rows.get("baseline")
        for name, row in rows.items():
            if base and name != "baseline":
                print(f"{name} vs baseline: held-out {row['heldout_loss'] / base['heldout_loss'] - 1:+.2%}, "
                      f"train loss at step {args.steps} {row['train_loss'] / base['train_loss'] - 1:+.2%}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
