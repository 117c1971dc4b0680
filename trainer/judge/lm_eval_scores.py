"""Benchmark scores through lm-eval (EleutherAI) on our model object: the scoring shared by scripts/eval_bench.py
(trained weights, one command) and the EvalBench callback (--eval_bench: scores logged during training)."""
import os
import random

import numpy as np
import torch

from model.atomic import full_disk_reason
from trainer.base.launch import is_main_process
from trainer.base.log import Logger
from trainer.judge.samples import bare_model

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
    """lm_eval, its HFLM and its TaskManager; BenchError (exit 3) naming the install command when it is missing."""
    try:  # optional dependency: only benchmark scoring needs it
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise BenchError(f"lm-eval is not installed ({e}); {INSTALL}", code=3) from None
    return lm_eval, HFLM, TaskManager


def task_names(spec, flag="--tasks"):
    """A comma list of lm-eval names as a list, "minimind" expanded to MiniMind's seven."""
    names = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        names += list(MINIMIND_TASKS) if name == "minimind" else [name]
    if not names:
        raise BenchError(f"{flag} is empty; pass lm-eval task names (comma-separated) or minimind")
    return names


def task_manager(TaskManager, include_path, names, flag="--include_path"):
    """lm-eval's task index: the include folder's YAML tasks alone where they hold every name (indexing lm-eval's own
    thousands of YAML files takes most of a minute), else lm-eval's built-in tasks plus them."""
    if include_path and not os.path.isdir(include_path):
        raise BenchError(f"{flag} {include_path} is not a folder of lm-eval task YAML files")
    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(own.all_tasks) | set(own.all_groups) | set(own.all_tags):
            return own
    return TaskManager(include_path=include_path)


def check_tasks(manager, names, flag="--tasks", include_flag="--include_path"):
    """Every name is an lm-eval task, group or tag: else one line naming it."""
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"{flag}: {', '.join(unknown)} is not an lm-eval task or group (`lm-eval ls tasks` lists "
                         f"them; your own YAML tasks need {include_flag})")


def run_tasks(lm_eval, lm, manager, names, limit, num_fewshot, seed):
    """lm_eval.simple_evaluate on the wrapped model; a dataset that cannot be fetched is a BenchError (exit 3)."""
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                       num_fewshot=num_fewshot, log_samples=False, random_seed=seed,
                                       numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
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


class EvalBench:
    """--eval_bench TASKS: every --eval_bench_interval optimizer steps and at the run's last step, the current model
    scored on lm-eval TASKS (one process); a record {"step", "bench/<task>/<metric>"} goes to the metrics sinks.
    The RNG states are restored after (lm-eval seeds them), so the training that follows is the one without it."""

    def __init__(self, names, include_path, limit, interval, tokenizer_path, batch_size=16):
        self.lm_eval, self.HFLM, TaskManager = import_lm_eval()
        self.names, self.limit, self.interval, self.batch_size = names, limit, interval, batch_size
        self.manager = task_manager(TaskManager, include_path, names, flag="--eval_bench_include")
        check_tasks(self.manager, names, flag="--eval_bench", include_flag="--eval_bench_include")
        from transformers import AutoTokenizer  # only a run that scores benchmarks needs it
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def on_step_end(self, trainer, record):
        step = trainer.progress.global_step
        if (not self.interval or step % self.interval) and step < trainer.total_steps:
            return
        scores = self.score(bare_model(trainer.model_parts[0]))
        tracker = next(cb for cb in trainer.callbacks if type(cb).__name__ == "Tracker")
        tracker.log(dict(step=step, **scores))
        if is_main_process():
            Logger(f"step {step} benchmarks: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    def score(self, model):
        """{"bench/<task>/<metric>": value} of the model now, in eval mode; its train mode and the RNGs put back."""
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        was_training = model.training
        model.eval()
        try:
            lm = self.HFLM(pretrained=model, tokenizer=self.tokenizer, batch_size=self.batch_size)
            results = run_tasks(self.lm_eval, lm, self.manager, self.names, self.limit, None, 0)
        finally:
            model.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        scores = {}
        for row in score_rows(results, self.names):
            for metric in ("acc", "acc_norm"):
                if row[metric] is not None:
                    scores[f"bench/{row['task']}/{metric}"] = row[metric]
        return scores
