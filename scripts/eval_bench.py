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

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from model.atomic import atomic_json, atomic_write, atomic_write_text, full_disk_reason  # noqa: E402
from scripts.eval_llm import add_model_args, load_or_exit, parsed  # noqa: E402
from trainer.trainer_utils import typed_or_default  # noqa: E402

# MiniMind's seven benchmarks: lm-eval's task (or group) name -> the label of the table and plot
MINIMIND_TASKS = {"ceval-valid": "C-Eval", "cmmlu": "CMMLU", "arc_easy": "ARC-Easy", "piqa": "PIQA",
                  "openbookqa": "OpenBookQA", "hellaswag": "HellaSwag", "social_iqa": "Social-IQa"}
INSTALL = "pip install 'lm-eval>=0.4.13,<=0.4.13'"


class BenchError(Exception):
    """Bad input (exit 2) or a failing dependency (exit 3): the message is the one line to print."""

    def __init__(self, message, code=2):
        super().__init__(message)
        self.code = code


def import_lm_eval():
    """lm_eval and its TaskManager; BenchError (exit 3) naming the install command when it is missing."""
    try:  # optional dependency: only this script needs it
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise BenchError(f"lm-eval is not installed ({e}); {INSTALL}", code=3) from None
    return lm_eval, HFLM, TaskManager


def task_names(spec):
    """--tasks as a list of lm-eval names, "minimind" expanded to MiniMind's seven."""
    names = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        names += list(MINIMIND_TASKS) if name == "minimind" else [name]
    if not names:
        raise BenchError("--tasks is empty; pass lm-eval task names (comma-separated) or minimind")
    return names


def task_manager(TaskManager, include_path, names):
    """lm-eval's task index: --include_path's YAML tasks alone where they hold every name (indexing lm-eval's own
    thousands of YAML files takes most of a minute), else lm-eval's built-in tasks plus them."""
    if include_path and not os.path.isdir(include_path):
        raise BenchError(f"--include_path {include_path} is not a folder of lm-eval task YAML files")
    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(own.all_tasks) | set(own.all_groups) | set(own.all_tags):
            return own
    return TaskManager(include_path=include_path)


def check_tasks(manager, names):
    """Every name is an lm-eval task, group or tag: else one line naming it."""
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"--tasks: {', '.join(unknown)} is not an lm-eval task or group (`lm-eval ls tasks` lists "
                         "them; your own YAML tasks need --include_path)")


def run_tasks(lm_eval, lm, manager, names, args):
    """lm_eval.simple_evaluate on the wrapped model; a dataset that cannot be fetched is a BenchError (exit 3)."""
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=args.limit,
                                       num_fewshot=args.num_fewshot, log_samples=False, random_seed=args.seed,
                                       numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                       fewshot_random_seed=args.seed)
    except (ConnectionError, OSError) as e:
        if full_disk_reason(e):
            raise
        raise BenchError(f"a task's dataset could not be loaded ({type(e).__name__}: {str(e)[:200]}); fetch it once "
                         "with network access (it is cached after) or check the task's dataset_path", code=3) from None


def score_rows(results, names):
    """One row per requested task: label, acc, acc_norm (None where the task has none), their stderr, samples."""
    rows = []
    for name in names:
        metrics = results["results"][name]
        rows.append(dict(task=name, label=MINIMIND_TASKS.get(name, name), acc=metrics.get("acc,none"),
                         acc_stderr=metrics.get("acc_stderr,none"), acc_norm=metrics.get("acc_norm,none"),
                         acc_norm_stderr=metrics.get("acc_norm_stderr,none"), samples=samples_of(results, name)))
    return rows


def samples_of(results, name):
    """Documents scored for a task, summed over a group's subtasks."""
    counts = results.get("n-samples", {})
    if name in counts:
        return counts[name]["effective"]
    return sum(samples_of(results, sub) for sub in results.get("group_subtasks", {}).get(name, []))


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
    results = run_tasks(lm_eval, lm, manager, names, args)
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
