"""Plot one or more --metrics_file JSONL files: loss, eval loss, lr, gradient norm, tokens/s, MFU, memory (and RL
rewards, MoE expert load per layer) against step.

    python scripts/plot_metrics.py out/pretrain_768_metrics.jsonl          # writes out/pretrain_768_metrics.png
    python scripts/plot_metrics.py a.jsonl b.jsonl --labels dp2,tp2 --out compare.png

Several files are drawn as one line each in every panel (compare layouts, resumes, configs). A step logged
twice (a resumed run's file written before truncation existed) keeps its last record. Panels without data are left out.
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "pandas and matplotlib")

import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402 (a plain Figure renders PNGs through Agg; no pyplot, no display)

from model.atomic import atomic_write, full_disk_reason  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

# (column, panel title, y scale factor, y label)
PANELS = [("loss", "loss", 1, "train loss"), ("eval_loss", "eval loss", 1, "validation loss"),
          ("eval_bpb", "bits per byte (eval)", 1, "bits per UTF-8 byte of the eval text"),
          ("lr", "learning rate", 1, "lr"), ("grad_norm", "gradient norm", 1, "L2 norm before clipping"),
          ("tokens_per_sec", "tokens/s", 1, "target tokens / s"),
          ("mfu", "MFU", 100, "% of peak FLOPs"), ("peak_mem_gb", "peak memory", 1, "GB (max over ranks)"),
          ("reward", "reward (RL)", 1, "mean reward of the step's completions"),
          ("completions/mean_length", "completion length (RL)", 1, "tokens"),
          ("ppo/mean_scores", "score (PPO)", 1, "mean reward of the rollout's completions"),
          ("tokens/responses_len_mean", "completion length (PPO)", 1, "tokens"),
          # a column ending in "/" is a prefix: one line per matching column (MoE: one per layer)
          ("expert_load_cv/", "MoE expert load", 1, "CV of tokens per expert (0: even)"),
          ("expert_tokens_min/", "MoE least-loaded expert", 1, "tokens in the step")]
PANEL_SIZE = (4.5, 3.2)  # inches per panel; the PNG is columns*4.5 x rows*3.2 inches at --dpi
COLUMNS = 4


def load_metrics(path):
    """A metrics JSONL as a DataFrame sorted by step, one row per (step, kind): training and eval records apart."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"line {number} is not JSON") from None
    frame = pd.DataFrame.from_records(records)
    if frame.empty or "step" not in frame:
        raise ValueError("no records with a step")
    frame["kind"] = frame["eval_loss"].notna().map({True: "eval", False: "train"}) if "eval_loss" in frame else "train"
    frame = frame.drop_duplicates(["step", "kind"], keep="last")
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def panel_columns(frame, column):
    """The frame's columns with data a panel draws: `column`, or every column under it when it ends in "/"."""
    names = [c for c in frame.columns if c.startswith(column)] if column.endswith("/") else [column]
    return [c for c in names if c in frame and frame[c].notna().any()]


def plot(frames, labels):
    """A figure with one panel per metric that has data; each (label, frame) is one line per panel."""
    panels = [p for p in PANELS if any(panel_columns(f, p[0]) for f in frames)]
    if not panels:
        raise ValueError("no plottable metrics (loss, eval_loss, lr, grad_norm, tokens_per_sec, mfu, peak_mem_gb) in "
                         "the files")
    columns = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (column, title, scale, ylabel) in zip(axes.flat, panels):
        lines = [(frame, label, name) for frame, label in zip(frames, labels) for name in panel_columns(frame, column)]
        for frame, label, name in lines:
            data = frame[frame[name].notna()]
            name_label = label if name == column else f"{label} {name.rsplit('/', 1)[1]}"
            ax.plot(data["step"], data[name] * scale, label=name_label, marker="." if len(data) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


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
