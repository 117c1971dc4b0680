"""Does the fast configuration learn as well as the reference mode? Train both, score both the same way.

    python scripts/quality.py --steps 200                                    # bench's small config
    python scripts/quality.py --steps 30 --hidden_size 128 --num_hidden_layers 2   # a quick look

The embedded pretraining corpus is split: the last --heldout documents are never trained on. Four
runs of the real trainer/train_pretrain.py, fp32, same seed, same training documents:
  baseline   --packing 0 --loss_chunk_size 0      pad to max_seq_len, full logits (bench's reference)
  fast-same  --packing 0 --loss_chunk_size 1024   the fast numerics on the baseline's very batches
  fast       --packing 1 --loss_chunk_size 1024   the fast configuration (bench's default; --doc_mask 1)
  fast-no-doc-mask   the same with --doc_mask 0: documents in a packed row attend to each other
Each run's final weights are scored by the trainer's own evaluate() (a second trainer run from those
weights: --learning_rate 0 for one step, --eval_data_path the held-out documents, --packing 0 and
--batch_size 1, so one document per row): mean CE per target token, the same measure for every run,
whatever its batches looked like. `fast-same` vs
`baseline` compares the training loss at the last step too (same batches, so it must agree);
`fast` sees ~3x more target tokens per step than the padded runs, so only the held-out loss is
like for like there. One JSON line per run goes to --results. Flags the script does not know go to
the trainer.

--sft: the same for SFT (trainer/train_sft.py on the embedded chat corpus, its last --heldout conversations
held out; --from_weight passes through, default none): sft-padded (--packing 0) against sft-packed
(--packing 1 --doc_mask 1), same steps and batch size; each row adds the median target tokens/s.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

import torch  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402
from model.weights.paths import ROOT, typed_or_default  # noqa: E402
from scripts.benchmarks.run import BENCH_DEFAULTS, TRAIN_SCRIPT, given_trainer_flags, run_trainer  # noqa: E402

RUNS = {"baseline": dict(packing=0, loss_chunk_size=0),
        "fast-same": dict(packing=0, loss_chunk_size=1024),
        "fast": dict(packing=1, loss_chunk_size=1024, doc_mask=1),
        "fast-no-doc-mask": dict(packing=1, loss_chunk_size=1024, doc_mask=0)}
SFT_RUNS = {"sft-padded": dict(packing=0), "sft-packed": dict(packing=1, doc_mask=1)}  # --sft
SFT_SCRIPT = os.path.join(ROOT, "trainer", "train_sft.py")
# a scoring run: one step at learning rate 0 (AdamW leaves the weights as they are), then evaluate() on every
# held-out document, one per row
SCORE_FLAGS = dict(learning_rate=0.0, warmup_steps=0, max_steps=1, packing=0, batch_size=1, accumulation_steps=1,
                   loss_chunk_size=0, eval_batches=10 ** 9, eval_interval=0, save_interval=10 ** 9)


def split_corpus(tmp, heldout, kind="pretrain"):
    """(train path, held-out path): the demo corpus without / with only its last `heldout` lines."""
    with open(ensure_demo_data(kind)) as f:
        lines = f.readlines()
    paths = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "heldout.jsonl")
    for path, part in zip(paths, (lines[:-heldout], lines[-heldout:])):
        with open(path, "w") as f:
            f.writelines(part)
    return paths


def train_and_score(name, flags, steps, train_path, heldout_path, tmp):
    """Train run `name` for `steps` steps, then score its weights on the held-out file; one results row."""
    work = os.path.join(tmp, name)
    script = SFT_SCRIPT if name in SFT_RUNS else TRAIN_SCRIPT
    run_flags = dict(flags, **{**RUNS, **SFT_RUNS}[name], data_path=train_path, max_steps=steps, log_interval=1,
                     save_interval=10 ** 9, save_dtype="float32")
    steps_log = [r for r in run_trainer(run_flags, os.path.join(tmp, f"{name}.log"), work=work, script=script)
                 if "loss" in r]
    weights = glob.glob(os.path.join(work, "out", "*.pth"))
    if len(weights) != 1:
        raise RuntimeError(f"expected one weights file in {work}/out, found {weights}")
    score_flags = dict(flags, **SCORE_FLAGS, data_path=train_path, eval_data_path=heldout_path, from_weight=weights[0])
    scored = run_trainer(score_flags, os.path.join(tmp, f"{name}-score.log"), work=os.path.join(work, "score"),
                         script=script)
    heldout = [r["eval_loss"] for r in scored if "eval_loss" in r]
    last10 = steps_log[-10:]
    return dict(run=name, steps=steps, train_loss=steps_log[-1]["loss"],
                train_loss_last10=sum(r["loss"] for r in last10) / len(last10),
                target_tokens=steps_log[-1]["tokens"], heldout_loss=heldout[-1],
                target_tokens_per_sec=statistics.median(r["tokens_per_sec"] for r in steps_log[1:] or steps_log),
                flags={k: v for k, v in run_flags.items() if k != "data_path"}, torch=torch.__version__)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=300, help="documents kept out of training")
    parser.add_argument("--runs", default=None, help=f"comma-separated subset of {','.join(RUNS)} "
                        f"(or with --sft of {','.join(SFT_RUNS)}; default: all)")
    parser.add_argument("--sft", action="store_true", help="SFT: padded vs packed rows on the embedded chat corpus")
    parser.add_argument("--results", default=None,
                        help="JSONL the rows are appended to (default: out/quality.jsonl in the repo)")
    args, rest = parser.parse_known_args(argv)
    runs = SFT_RUNS if args.sft else RUNS
    args.runs = args.runs or ",".join(runs)
    unknown = [name for name in args.runs.split(",") if name not in runs]
    if unknown:
        parser.error(f"--runs {','.join(unknown)} unknown; choose from {','.join(runs)}")
    flags = dict(BENCH_DEFAULTS, dtype="float32", seed=42, **(dict(from_weight="none") if args.sft else {}),
                 **given_trainer_flags(parser, rest))
    tmp = tempfile.mkdtemp(prefix="quality_")
    results = typed_or_default(args.results, os.path.join("out", "quality.jsonl"))
    os.makedirs(os.path.dirname(results), exist_ok=True)
    try:
        train_path, heldout_path = split_corpus(tmp, args.heldout, "sft" if args.sft else "pretrain")
        rows = {}
        for name in args.runs.split(","):
            row = rows[name] = train_and_score(name, flags, args.steps, train_path, heldout_path, tmp)
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name:10s} step {args.steps}: train loss {row['train_loss']:.4f} "
                  f"(last 10: {row['train_loss_last10']:.4f}), held-out loss {row['heldout_loss']:.4f}, "
                  f"target tokens seen {row['target_tokens']}, {row['target_tokens_per_sec']:.0f}/s", flush=True)
        base_name = "sft-padded" if args.sft else "baseline"
        base = rows.get(base_name)
        for name, row in rows.items():
            if base and name != base_name:
                print(f"{name} vs {base_name}: held-out {row['heldout_loss'] / base['heldout_loss'] - 1:+.2%}, "
                      f"train loss at step {args.steps} {row['train_loss'] / base['train_loss'] - 1:+.2%}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
