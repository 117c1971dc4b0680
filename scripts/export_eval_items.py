"""Export lm-eval tasks' items (as scripts/eval_bench.py scores them) to JSONL, one file per task, for
scripts/curate_data.py --eval_path (decontamination).

    python scripts/export_eval_items.py --tasks minimind --out_dir eval_items        # MiniMind's seven tasks
    python scripts/curate_data.py --data_path raw/ --out_dir curated --eval_path "$(ls eval_items/*.jsonl | paste -sd,)"

Each row: {"query": the prompt lm-eval renders, "choices": [...] (multiple choice), "target": the gold answer}.
The tasks' datasets come from the Hugging Face hub the first time and from its cache after; offline without that
cache the export stops with one line (exit 3) naming the task.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model.atomic import atomic_write_text  # noqa: E402
from trainer.judge.lm_eval_scores import BenchError, check_tasks, import_lm_eval, task_manager, task_names  # noqa: E402


def task_items(task):
    """{"query", "choices", "target"} of every evaluation document of an lm-eval task object."""
    for doc in task.eval_docs:
        item = {"query": task.doc_to_text(doc)}
        if task.OUTPUT_TYPE == "multiple_choice":
            item["choices"] = task.doc_to_choice(doc)
        target = task.doc_to_target(doc)
        if isinstance(target, int) and "choices" in item and 0 <= target < len(item["choices"]):
            target = item["choices"][target]  # the answer's text: what a leaked document would hold
        item["target"] = target if isinstance(target, str) else json.dumps(target, ensure_ascii=False)
        yield item


def leaf_tasks(task_dict):
    """(name, task) of every task in lm-eval's (possibly grouped) task dict."""
    for key, value in task_dict.items():
        if isinstance(value, dict):
            yield from leaf_tasks(value)
        else:
            yield getattr(key, "group_name", key) if not isinstance(key, str) else key, value


def export(tasks, out_dir, include_path=None):
    """Write <out_dir>/<task>.jsonl per task; return {task: items}."""
    _, _, TaskManager = import_lm_eval()
    names = task_names(tasks)
    manager = task_manager(TaskManager, include_path, names)
    check_tasks(manager, names)
    from lm_eval.tasks import get_task_dict  # optional dependency, imported by import_lm_eval above
    try:
        task_dict = get_task_dict(names, manager)
    except (ConnectionError, OSError) as e:
        raise BenchError(f"a task's dataset could not be loaded ({type(e).__name__}: {str(e)[:200]}); fetch it once "
                         "with network access (it is cached after)", code=3) from None
    counts = {}
    for name, task in leaf_tasks(task_dict):
        items = list(task_items(task))
        atomic_write_text(os.path.join(out_dir, f"{name}.jsonl"),
                          "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items))
        counts[name] = len(items)
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="minimind", help="lm-eval task names, comma-separated, or minimind")
    parser.add_argument("--include_path", default=None, help="a folder of your own lm-eval task YAML files")
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args(argv)
    try:
        counts = export(args.tasks, os.path.abspath(args.out_dir), args.include_path)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    for name, n in counts.items():
        print(f"{name}: {n} items -> {os.path.join(args.out_dir, name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
