"""Benchmark scores of trained weights in one command: lm-eval (EleutherAI) run through its Python API on our own model
(no export step), a results table printed and written (markdown + JSON) and a radar/bar plot, as MiniMind reports them.

    python scripts/eval_bench.py --weight full_sft                      # out/full_sft_768.pth on MiniMind's seven tasks
    python scripts/eval_bench.py --weight out/pretrain_768.pth --tasks arc_easy,piqa --limit 200
    python scripts/eval_bench.py --checkpoint checkpoints/pretrain_768/step_2000 --tasks hellaswag
    python scripts/eval_bench.py --load_from out/hf_model --tasks my_task --include_path my_tasks/   # own YAML tasks

--tasks takes lm-eval task or group names, comma-separated; "minimind" stands for MiniMind's seven (C-Eval, CMMLU,
ARC-Easy, PIQA, OpenBookQA, HellaSwag, Social-IQa). Their datasets come from the Hugging Face hub the first time and
from its cache after (HF_DATASETS_OFFLINE=1 then runs without network). Needs `pip install lm-eval`.
Writes <out_dir>/<name>.md, <name>.json and <name>.png (default out_dir: the repo's out/eval_bench).
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from model.atomic import atomic_json, atomic_write, atomic_write_text, full_disk_reason  # noqa: E402
from model.weights.paths import typed_or_default  # noqa: E402
from scripts.inference.flags import add_model_args, parsed  # noqa: E402
from scripts.inference.load import load_or_exit  # noqa: E402
from trainer.judge.lm_eval_scores import (  # noqa: E402, F401
    INSTALL,
    MINIMIND_TASKS,
    BenchError,
    check_tasks,
    import_lm_eval,
    run_tasks,
    score_rows,
    task_manager,
    task_names,
)

loaded()  # the imports are done: the script's own Ctrl-C handling from here


def percent(value):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def markdown_table(rows, title):
    """The scores as a markdown table (percent), an average row over the tasks' acc."""
    lines = [f"### {title}", "", "| task | acc | acc_norm | samples |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['label']} | {percent(r['acc'])} | {percent(r['acc_norm'])} | {r['samples']} |")
    accs = [r["acc"] for r in rows if r["acc"] is not None]
    if accs:
        lines.append(f"| average | {percent(sum(accs) / len(accs))} | | |")
    return "\n".join(lines) + "\n"


def plot_scores(rows, path, title):
    """acc per task as a radar chart (3 tasks or more, as MiniMind's) or a bar chart, written atomically as PNG."""
    rows = [r for r in rows if r["acc"] is not None]
    labels, values = [r["label"] for r in rows], [100 * r["acc"] for r in rows]
    if len(rows) >= 3:
        fig = plt.figure(figsize=(6, 6))
        ax = fig.add_subplot(projection="polar")
        angles = [2 * math.pi * i / len(rows) for i in range(len(rows))]
        ax.plot(angles + angles[:1], values + values[:1], marker="o")
        ax.fill(angles + angles[:1], values + values[:1], alpha=0.25)
        ax.set_xticks(angles, labels)
        ax.set_ylim(0, 100)
    else:
        fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 4))
        ax.bar(labels, values)
        ax.set_ylim(0, 100)
        ax.set_ylabel("acc (%)")
    ax.set_title(title)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def write_report(rows, results, args, weights):
    """<out_dir>/<name>.md, .json, .png; returns the markdown."""
    out_dir = typed_or_default(args.out_dir, os.path.join("out", "eval_bench"))
    name = args.name or os.path.basename(os.path.normpath(weights)).removesuffix(".pth")
    title = f"{name}" + (f" (limit {args.limit:g})" if args.limit is not None else "")
    table = markdown_table(rows, title)
    atomic_write_text(os.path.join(out_dir, name + ".md"), table)
    report = dict(weights=weights, tasks=[r["task"] for r in rows], limit=args.limit, num_fewshot=args.num_fewshot,
                  lm_eval_version=results.get("lm_eval_version"), scores=rows,
                  results={k: v for k, v in results["results"].items()})
    atomic_json(json.loads(json.dumps(report, default=str)), os.path.join(out_dir, name + ".json"))
    if rows:
        plot_scores(rows, os.path.join(out_dir, name + ".png"), title)
    print(f"wrote {os.path.join(out_dir, name)}.md/.json/.png", flush=True)
    return table


def evaluate(args):
    """Load the weights, wrap the model for lm-eval (its HFLM over our model object), score, write the report."""
    lm_eval, HFLM, TaskManager = import_lm_eval()
    names = task_names(args.tasks)
    manager = task_manager(TaskManager, args.include_path, names)
    check_tasks(manager, names)
    model, tokenizer = load_or_exit(args)
    weights = args.load_from or args.checkpoint or args.weight
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, max_length=args.max_length)
    results = run_tasks(lm_eval, lm, manager, names, args.limit, args.num_fewshot, args.seed)
    rows = score_rows(results, names)
    table = write_report(rows, results, args, weights)
    print(table, flush=True)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind benchmark evaluation through lm-eval")
    add_model_args(parser, weight="full_sft")
    parser.add_argument("--tasks", default="minimind",
                        help="lm-eval task/group names, comma-separated; minimind = MiniMind's seven")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a number >= 1), or a fraction of each task (< 1)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="default: each task's own")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=None, help="longest input in tokens (default: the model's)")
    parser.add_argument("--include_path", default=None, help="a folder of your own lm-eval task YAML files")
    parser.add_argument("--out_dir", default=None, help="where the table and plot go (default: the repo's "
                        "out/eval_bench)")
    parser.add_argument("--name", default=None, help="file name of the report (default: the weights' name)")
    # eval_llm's loader checks its sampling flags; scoring never samples
    parser.set_defaults(max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0, open_thinking=0)
    args = parsed(parser, argv)
    if args.limit is not None and not (args.limit > 0 and (args.limit < 1 or args.limit.is_integer())):
        raise BenchError(f"--limit must be a whole number of documents or a fraction in (0, 1) (got {args.limit:g})")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    if args.batch_size < 1:
        raise BenchError(f"--batch_size must be at least 1 (got {args.batch_size})")
    args.include_path = os.path.abspath(args.include_path) if args.include_path else None
    return args


def main(argv=None):
    try:
        return evaluate(parse_args(argv))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
    except OSError as e:
        if not full_disk_reason(e):
            raise
        print(f"error: {full_disk_reason(e)} while writing the report; free space or pass --out_dir", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
