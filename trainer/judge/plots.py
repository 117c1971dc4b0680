"""The curves of --metrics_file JSONL files: one panel per metric (loss, eval loss, bits per byte, lr, gradient norm,
tokens/s, MFU, memory, RL rewards and lengths, MoE expert load per layer) against step, one line per file.
scripts/plot_metrics.py draws them alone; trainer/judge/report.py beside a run's report. Imported only where a
plot is made (pandas and matplotlib take a second or two to import), never by a run that writes no report.
"""
import json
import math

import pandas as pd
from matplotlib.figure import Figure  # a plain Figure renders PNGs through Agg; no pyplot, no display

# (column, panel title, y scale factor, y label)
PANELS = [("loss", "loss", 1, "train loss"), ("eval_loss", "eval loss", 1, "validation loss"),
          ("eval_bpb", "bits per byte (eval)", 1, "bits per UTF-8 byte of the eval text"),
          ("lr", "learning rate", 1, "lr"), ("grad_norm", "gradient norm", 1, "L2 norm before clipping"),
          ("tokens_per_sec", "tokens/s", 1, "target tokens / s"),
          ("mfu", "MFU", 100, "% of peak FLOPs"), ("peak_mem_gb", "peak memory", 1, "GiB (max over ranks)"),
          ("reward", "reward (RL)", 1, "mean reward of the step's completions"),
          ("completions/mean_length", "completion length (RL)", 1, "tokens"),
          ("ppo/mean_scores", "score (PPO)", 1, "mean reward of the rollout's completions"),
          ("tokens/responses_len_mean", "completion length (PPO)", 1, "tokens"),
          # a column ending in "/" is a prefix: one line per matching column (MoE: one per layer)
          ("expert_load_cv/", "MoE expert load", 1, "CV of tokens per expert (0: even)"),
          ("expert_tokens_min/", "MoE least-loaded expert", 1, "tokens in the step")]
PANEL_SIZE = (4.5, 3.2)  # inches per panel; the PNG is columns*4.5 x rows*3.2 inches at --dpi
COLUMNS = 4


def read_records(path):
    """(records, cut) of a metrics JSONL: cut when its last line was cut short (a run stopped while writing it: no
    newline at its end, not JSON), a line left out as a resume drops it; ValueError naming any other line not JSON."""
    with open(path) as f:
        lines = f.readlines()
    records, cut = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) or line.endswith("\n"):
                raise ValueError(f"line {number} is not JSON") from None
            cut = True
    return records, cut


def metrics_frame(records):
    """Metrics records as a DataFrame sorted by step, one row per (step, kind): training and eval records apart."""
    frame = pd.DataFrame.from_records(records)
    if frame.empty or "step" not in frame:
        raise ValueError("no records with a step")
    frame["kind"] = frame["eval_loss"].notna().map({True: "eval", False: "train"}) if "eval_loss" in frame else "train"
    frame = frame.drop_duplicates(["step", "kind"], keep="last")
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def load_metrics(path):
    """A metrics JSONL as metrics_frame's DataFrame (a last line cut short left out: read_records)."""
    return metrics_frame(read_records(path)[0])


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
    colours = {(i, ""): f"C{i % 10}" for i in range(len(frames))}  # a file's line keeps its colour in every panel
    for ax, (column, title, scale, ylabel) in zip(axes.flat, panels):
        lines = [(i, name) for i, frame in enumerate(frames) for name in panel_columns(frame, column)]
        for i, name in lines:
            data, part = frames[i][frames[i][name].notna()], "" if name == column else name.rsplit("/", 1)[1]
            colour = colours.setdefault((i, part), f"C{len(colours) % 10}")  # a MoE layer: a colour of its own
            ax.plot(data["step"], data[name] * scale, label=f"{labels[i]} {part}".strip(), color=colour,
                    marker="." if len(data) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1 or len(frames) > 1:  # several files: the legend says whose line a panel holds
            ax.legend(fontsize="small")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig
