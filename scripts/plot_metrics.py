"""Plot one or more --metrics_file JSONL files: loss, eval loss, lr, gradient norm, tokens/s, MFU, memory (and RL
rewards, MoE expert load per layer) against step.

    python scripts/plot_metrics.py out/pretrain_768_metrics.jsonl          # writes out/pretrain_768_metrics.png
    python scripts/plot_metrics.py a.jsonl b.jsonl --labels dp2,tp2 --out compare.png

Several files are drawn as one line each in every panel (compare layouts, resumes, configs). A step logged
twice (a resumed run's file written before truncation existed) keeps its last record. Panels without data are left out.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "pandas and matplotlib")

from model.atomic import atomic_write, full_disk_reason  # noqa: E402
from trainer.judge.plots import load_metrics, plot  # noqa: E402 (the panels: trainer/judge/plots.py)

loaded()  # the imports are done: the script's own Ctrl-C handling from here


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot --metrics_file JSONL files (one line per file in each panel)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("files", nargs="+", help="metrics JSONL files written by the trainer")
    parser.add_argument("--out", default=None, help="PNG to write (default: out/<first file's name>.png in the repo)")
    parser.add_argument("--labels", default=None,
                        help="comma-separated legend names, one per file; unset: the file names")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch of the PNG")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(f) for f in args.files]
    if len(labels) != len(args.files):
        parser.exit(2, f"error: --labels has {len(labels)} names for {len(args.files)} files; give one per file\n")
    frames = []
    for path in args.files:
        if not os.path.isfile(path):
            parser.exit(2, f"error: metrics file {path} not found; pass a --metrics_file the trainer wrote\n")
        try:
            frames.append(load_metrics(path))
        except ValueError as e:  # empty file or not JSON lines
            parser.exit(2, f"error: {path} is not a metrics JSONL ({e}); pass a --metrics_file the trainer wrote\n")
    try:
        fig = plot(frames, labels)
    except ValueError as e:
        parser.exit(2, f"error: {e}; pass a --metrics_file the trainer wrote\n")
    out = os.path.abspath(args.out) if args.out else os.path.join(
        ROOT, "out", os.path.splitext(os.path.basename(args.files[0]))[0] + ".png")  # a default under the repo's out/
    fmt = os.path.splitext(out)[1][1:].lower() or "png"
    try:
        atomic_write(out, lambda f: fig.savefig(f, dpi=args.dpi, format=fmt))  # the old image or the new one, whole
    except OSError as e:
        reason = full_disk_reason(e)
        if reason is None:
            raise
        parser.exit(3, f"error: disk full writing {out} ({reason}); the image there is as it was; free space or "
                       "choose another --out\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
