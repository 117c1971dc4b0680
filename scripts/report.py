"""A run's report a person reads: a markdown page with its plots beside it (trainer/judge/report.py).

    python scripts/report.py out/full_sft_256_metrics.jsonl                 # out/full_sft_256_report.md + .png
    python scripts/report.py out/pretrain_256_metrics.jsonl out/pretrain_512_metrics.jsonl --out out/compare.md
    python scripts/report.py RUN --reference docs/reference/clean/sft_64_metrics.jsonl  # a reference curve drawn too

RUN is a --metrics_file the trainer wrote (<save_dir>/<run>_metrics.jsonl); a run writes its own report at its end
with --report 1 (default auto: runs of a minute or more). Beside RUN the report reads, when they are there: the
weights' sidecar, the rank-0 log, the run's flags <checkpoint_dir>/<run>_config.yaml (--run_config, else checkpoints/
beside the save_dir) and the eval samples. The page: files, config, data, the numbers and curves, samples with their
repetition, eval_bench scores, the health lines. Two runs or more: one column each, their curves in the same panels.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "pandas and matplotlib")

from trainer.judge.report import write_report  # noqa: E402

loaded()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="metrics JSONL files the trainer wrote (one: its report; several: "
                        "side by side)")
    parser.add_argument("--out", default=None, help="the markdown page (default: <save_dir>/<run>_report.md); the "
                        "plots go beside it as .png")
    parser.add_argument("--reference", default=None, help="a metrics JSONL drawn in the curves as a reference")
    parser.add_argument("--run_config", default=None, help="the run's flags (<checkpoint_dir>/<run>_config.yaml)")
    args = parser.parse_args(argv)
    for path in args.runs + ([args.reference] if args.reference else []):
        if not os.path.isfile(path):
            parser.exit(2, f"error: metrics file {path} not found; pass a --metrics_file the trainer wrote\n")
    try:
        out, png = write_report(args.runs, args.out, args.reference, args.run_config)
    except ValueError as e:
        parser.exit(2, f"error: {e}; pass a --metrics_file the trainer wrote\n")
    print(f"wrote {out} and {png}")
    return out


if __name__ == "__main__":
    main()
