"""A run's report a person reads: a markdown page with its plots beside it (scripts/report.py, and the end of a run
under --report: trainer/observe/health_watch.py's HealthWatch imports it there, so a run without a report does
not).

A run is its --metrics_file (<save_dir>/<run>_metrics.jsonl). Beside it the report reads, when they are there: the
weights' sidecar <save_dir>/<run>.json (the model config), the rank-0 log <save_dir>/logs/<run>_rank_0.log (the data
line, the curation and data notes), the run's flags <checkpoint_dir>/<run>_config.yaml (run_config, else checkpoints/
beside the save_dir), and the eval samples <run>_metrics_samples.jsonl. The page: files, config, data, the numbers and
curves (trainer/judge/plots.py's panels: train/eval loss, bits per byte, lr, grad norm, tokens/s, memory), samples with
their repetition, eval_bench scores, the health lines (trainer/judge/health.py). Two runs or more: one column each,
their curves in the same panels.
"""
import itertools
import json
import os
import statistics

import yaml

from model.atomic import atomic_write, atomic_write_text
from trainer.judge.health import scan
from trainer.judge.plots import metrics_frame, plot, read_records

MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "use_moe", "num_experts", "num_experts_per_tok", "step")
LOG_LINES = ("Data:", "--skip_bad_lines", "curat", "note:", "warning:", "Done:", "preempted", "stopped:")


class Run:
    """One run's files, found from its metrics file."""

    def __init__(self, metrics, run_config=None):
        self.metrics = os.path.abspath(metrics)
        save_dir, base = os.path.split(self.metrics)
        self.name = base[:-len("_metrics.jsonl")] if base.endswith("_metrics.jsonl") else os.path.splitext(base)[0]
        flags = os.path.abspath(run_config) if run_config else os.path.join(os.path.dirname(save_dir), "checkpoints",
                                                                              self.name + "_config.yaml")
        candidates = dict(weights=os.path.join(save_dir, self.name + ".pth"),
                          sidecar=os.path.join(save_dir, self.name + ".json"),
                          log=os.path.join(save_dir, "logs", self.name + "_rank_0.log"),
                          samples=os.path.splitext(self.metrics)[0] + "_samples.jsonl",
                          run_config=flags)
        self.files = {"metrics": self.metrics, **{k: p for k, p in candidates.items() if os.path.isfile(p)}}
        try:  # cut: the last line was cut short (a run stopped while writing it), left out as a resume drops it
            self.records, self.cut = read_records(self.metrics)
            self.frame = metrics_frame(self.records)
        except ValueError as e:
            raise ValueError(f"{self.metrics}: {e}") from None
        self.train = [r for r in self.records if "loss" in r]
        self.evals = [r for r in self.records if "eval_loss" in r]

    def model_config(self):
        if "sidecar" not in self.files:
            return {}
        with open(self.files["sidecar"]) as f:
            config = json.load(f)
        moe = ("num_experts", "num_experts_per_tok")
        return {k: config[k] for k in MODEL_KEYS if k in config and (config.get("use_moe") or k not in moe)}

    def flags(self):
        """The run's flags as its config file holds them ({} when it is not beside the run)."""
        if "run_config" not in self.files:
            return {}
        with open(self.files["run_config"]) as f:
            flags = yaml.safe_load(f)
        return flags if isinstance(flags, dict) else {}

    def peak_basis(self):
        """What the run's files say of the peak behind its MFU: provisional (a CPU's peak measured on busy cores, the
        MFU reads high) at how many of its logged steps, the device and dtype its flags name; None without an MFU."""
        steps = [r for r in self.train if "mfu" in r]
        if not steps:
            return None
        provisional, flags = sum(bool(r.get("mfu_provisional")) for r in steps), self.flags()
        peak = ("provisional (a CPU's, measured on busy cores: the MFU reads high)" if provisional == len(steps) else
                "settled (a CPU's measured on quiet cores, or a GPU's)" if not provisional else
                f"provisional at {provisional} of {len(steps)} logged steps, settled at the others")
        return dict(peak=peak, device=flags.get("device"), dtype=flags.get("dtype"))

    def log_lines(self):
        if "log" not in self.files:
            return []
        with open(self.files["log"], errors="replace") as f:
            return [line.strip() for line in f if any(mark in line for mark in LOG_LINES)]

    def samples(self):
        """The last eval's samples: [{"step", "prompt", "text", "repeated_4gram", "distinct_2"}]."""
        if "samples" not in self.files:
            return []
        with open(self.files["samples"]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        last = max(r["step"] for r in rows) if rows else None
        return [r for r in rows if r["step"] == last]

    def numbers(self):
        """{label: value text} of the run's figures."""
        train, evals, out = self.train, self.evals, {}
        if train:
            out["steps"] = str(train[-1]["step"])
            out["tokens trained"] = f"{train[-1].get('tokens', 0):,}"
            out["first / last train loss"] = f"{train[0]['loss']:.4f} / {train[-1]['loss']:.4f}"
            rates = [r["tokens_per_sec"] for r in train[1:] if "tokens_per_sec" in r] or [0.0]
            out["tokens/s (median)"] = f"{statistics.median(rates):.0f}"
            out["peak memory GiB"] = f"{max(r.get('peak_mem_gb', 0.0) for r in train):.2f}"
        if evals:
            out["last eval loss"] = f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})"
            if "eval_bpb" in evals[-1]:
                out["last eval bits per byte"] = f"{evals[-1]['eval_bpb']:.4f}"
        bench = {k: v for r in self.records for k, v in r.items() if k.startswith("bench/")}
        out.update({k: f"{v:.4f}" for k, v in sorted(bench.items())})
        return out

    def health(self):
        vocab = self.model_config().get("vocab_size", 6400)
        return scan(self.records, vocab)


def single_page(run, png, reference=None):
    """The markdown of one run (`reference`: the Run drawn beside it in the curves)."""
    lines = [f"# Run report: {run.name}", "", "## Files", ""]
    lines += [f"- {kind}: `{path}`" for kind, path in run.files.items()] + [f"- plots: `{png}`"]
    lines += [f"- reference curve: `{reference.metrics}`", ""] if reference else [""]
    lines += ["## Config", ""] + [f"- {k}: {v}" for k, v in run.model_config().items()]
    if "run_config" in run.files:
        with open(run.files["run_config"]) as f:
            lines += ["", "<details><summary>flags</summary>", "", "```yaml", f.read().rstrip(), "```", "</details>"]
    lines += ["", "## Data", ""] + [f"- {line}" for line in run.log_lines()] or ["- (no rank log beside the run)"]
    lines += ["", "## Numbers", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in run.numbers().items()]
    lines += ["", "## Curves", "", f"![curves]({os.path.basename(png)})", ""] + curve_notes([run], reference)
    samples = run.samples()
    if samples:
        lines += [f"## Samples (greedy, step {samples[0]['step']})", "", "| prompt | repeated 4-grams | distinct-2 | "
                  "text |", "|---|---|---|---|"]
        lines += [f"| {s['prompt']} | {s['repeated_4gram']:.0%} | {s['distinct_2']:.2f} | {cell(s['text'])} |"
                  for s in samples] + [""]
    health = run.health()
    lines += ["## Health", ""] + ([f"- step {step}: {line}" for _, step, line in health] or ["- no health line"])
    return "\n".join(lines) + "\n"


def side_by_side(runs, png, reference=None):
    """The markdown of several runs: one column each (`reference`: the Run drawn beside them in the curves)."""
    names = [r.name for r in runs]
    numbers = [r.numbers() for r in runs]
    keys = list(dict.fromkeys(k for n in numbers for k in n))
    lines = [f"# Runs side by side: {', '.join(names)}", "", "| | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(runs)]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(n.get(key, "") for n in numbers) + " |")
    configs = [r.model_config() for r in runs]
    for key in MODEL_KEYS:
        if any(key in c for c in configs):
            lines.append(f"| {key} | " + " | ".join(str(c.get(key, "")) for c in configs) + " |")
    lines += ["", f"![curves]({os.path.basename(png)})", ""] + curve_notes(runs, reference) + ["## Health", ""]
    for run in runs:
        found = run.health()
        lines += [f"- {run.name}: " + ("; ".join(f"step {s}: {line}" for _, s, line in found) or "no health line")]
    lines += ["", "## Files", ""] + [f"- {r.name}: " + ", ".join(f"`{p}`" for p in r.files.values()) for r in runs]
    return "\n".join(lines) + "\n"


def curve_notes(runs, reference=None):
    """Markdown lines under the curves: each metrics file whose last line was cut short, MFUs that do not compare."""
    named = [(run.name, run) for run in runs] + ([(f"reference ({reference.name})", reference)] if reference else [])
    notes = [f"note: the last line of `{run.metrics}` was cut short (the run was stopped while writing it); the page "
             "shows the records before it, as a resume of the run keeps them" for _, run in named if run.cut]
    notes += [note for note in [mfu_note(named)] if note]
    return [line for note in notes for line in (note, "")]


def mfu_note(named_runs):
    """A note when the MFU curves drawn together are against peaks measured differently ([(name, Run)]: provisional
    or settled, the device and dtype where both runs' flags name them), else None."""
    bases = [(name, basis) for name, run in named_runs if (basis := run.peak_basis())]

    def same(a, b):
        return a["peak"] == b["peak"] and all(a[k] == b[k] for k in ("device", "dtype") if a[k] and b[k])
    if all(same(a, b) for (_, a), (_, b) in itertools.combinations(bases, 2)):
        return None
    described = "; ".join(f"{name}: peak {b['peak']}" + "".join(f", {k} {b[k]}" for k in ("device", "dtype") if b[k])
                          for name, b in bases)
    return (f"note: these MFU curves are against peaks measured differently, so they do not compare: {described}. "
            "The records do not name the machine: MFUs compare between runs on one machine with settled peaks.")


def cell(text):
    """Text for a markdown table cell: one line, pipes escaped, at most 160 characters."""
    text = text.replace("\n", "\\n").replace("|", "\\|") or "(empty)"
    return text[:160] + ("..." if len(text) > 160 else "")


def write_report(metrics_files, out=None, reference=None, run_config=None):
    """Write the page of one run (or several side by side) and its plots beside it: (page path, png path).
    out: default <save_dir>/<run>_report.md; reference: a metrics JSONL drawn in the curves; run_config: the run's
    flags file (one run). ValueError where a metrics file holds no records."""
    runs = [Run(path, run_config if len(metrics_files) == 1 else None) for path in metrics_files]
    out = os.path.abspath(out or os.path.join(os.path.dirname(runs[0].metrics), runs[0].name + "_report.md"))
    png = os.path.splitext(out)[0] + ".png"
    reference = Run(reference) if reference else None
    frames, labels = [r.frame for r in runs], [r.name for r in runs]
    if reference:
        frames, labels = frames + [reference.frame], labels + ["reference"]
    figure = plot(frames, labels)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    atomic_write(png, lambda f: figure.savefig(f, dpi=80, format="png"))
    page = single_page(runs[0], png, reference) if len(runs) == 1 else side_by_side(runs, png, reference)
    atomic_write_text(out, page)
    return out, png
