"""Callbacks: the short list of hooks the loop calls (trainer/core/loop.py), for what a run does besides a step.

Every hook is optional; an object with any of them is a callback (`--callbacks FILE.py:NAME` adds one):
  on_step_end(trainer, record)  after every optimizer step; `record` is the logged record (a dict) on log steps,
                                else None (reading trainer.guard.last_loss costs nothing: the guard synced it)
  on_eval(trainer, record)      after each validation run: {"step", "eval_loss", "eval_ppl"}
  on_save(trainer, step)        after the resume checkpoint of `step` is written (staged, under --async_save)
  on_train_end(trainer)         once, when the loop is done (not after an error)
Every rank calls every hook at the same point, so a hook may run collectives (all ranks see the same records).
A callback stops the run after this step by setting `self.stop_reason` (a line the run prints), and asks for a
checkpoint of this step by setting `self.save_step` to it. `state_dict()` / `load_state_dict(state)`, if present,
travel in every checkpoint, so a resumed run continues with the same state.
Built in, through the same hooks: the sinks (tracking.Tracker), eval_callbacks.EarlyStopping and BestCheckpoint,
RankLog, lm_eval_scores.EvalBench (--eval_bench: lm-eval scores of the current model), health_watch.HealthWatch
(health lines) and samples.Samples (greedy samples at each eval, SFT and later stages).
"""
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from model.errors import ConfigError
from trainer.base.errors import TrainingHalted
from trainer.base.rank_log import RankLog
from trainer.base.schema import Flag, fill
from trainer.observe.health_watch import HealthWatch

HOOKS = ("on_step_end", "on_eval", "on_save", "on_train_end")


@dataclass(frozen=True)
class CallbackPlan:
    """Best checkpoint, early stopping and a user's callbacks (trainer/runtime/callbacks.py)."""
    save_best: bool
    early_stop_patience: int
    early_stop_min_delta: float
    eval_bench: Optional[str]
    eval_bench_interval: int
    eval_bench_include: Optional[str]
    eval_bench_limit: Optional[int]
    user: tuple  # ((file, name), ...) of --callbacks
    FLAGS = (
        Flag("save_best", bool, 0, "keep the checkpoint with the lowest eval_loss (never pruned, in "
             "<checkpoint_dir>/<run>/best.json) and its weights as <save_weight>_<hidden>[_moe]_best.pth"),
        Flag("early_stop_patience", int, 0, "stop after this many --eval_interval evals without an eval_loss below "
             "the best by more than --early_stop_min_delta (0: off)", min=0, hint="0 is off"),
        Flag("early_stop_min_delta", float, 0.0, "the improvement early stopping asks for"),
        Flag("eval_bench", str, None, "lm-eval task names, comma-separated (minimind: MiniMind's seven), scored on "
             "the current model during training, logged as bench/<task>/<metric> (one process; pip install lm-eval)"),
        Flag("eval_bench_interval", int, 0, "optimizer steps between --eval_bench scorings (0: the run's last step "
             "only; the last step is always scored)", min=0, hint="0 is the last step only"),
        Flag("eval_bench_include", str, None, "a folder of your own lm-eval task YAML files for --eval_bench"),
        Flag("eval_bench_limit", int, None, "documents per --eval_bench task (default: all)", min=1),
        Flag("callbacks", str, None, "comma list of FILE.py:NAME, a class (made with no arguments) or object with any "
             "of on_step_end, on_eval, on_save, on_train_end (trainer/runtime/callbacks.py)"),
    )


def resolve_callbacks(args, has_eval):
    """The CallbackPlan; ConfigError for a flag that cannot work (no eval data, a missing file)."""
    if (args.save_best or args.early_stop_patience) and not has_eval:
        flag = "--save_best 1" if args.save_best else "--early_stop_patience"
        raise ConfigError(f"{flag} follows the eval loss: give --eval_data_path (and --eval_interval)")
    if args.early_stop_patience and not args.eval_interval:
        raise ConfigError("--early_stop_patience counts evals every --eval_interval steps: set --eval_interval")
    if not args.early_stop_min_delta >= 0:
        raise ConfigError(f"--early_stop_min_delta must be 0 or more (got {args.early_stop_min_delta})")
    user = []
    for spec in filter(None, (args.callbacks or "").split(",")):
        path, _, name = spec.strip().rpartition(":")
        if not path.endswith(".py") or not name:
            raise ConfigError(f"--callbacks {spec}: write FILE.py:NAME (a class or object in that file)")
        if not os.path.isfile(path):
            raise ConfigError(f"--callbacks {spec}: {path} does not exist")
        user.append((os.path.abspath(path), name))
    include = check_eval_bench(args)
    return fill(CallbackPlan, args, user=tuple(user), eval_bench_include=include)


def check_eval_bench(args):
    """--eval_bench's flags: one process, lm-eval installed (else exit 3 naming the pip command), a task list;
    returns the include folder as an absolute path."""
    if args.eval_bench is None:
        for name in ("eval_bench_interval", "eval_bench_include", "eval_bench_limit"):
            if getattr(args, name):
                raise ConfigError(f"--{name} sets up --eval_bench: give --eval_bench TASKS too")
        return None
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError("--eval_bench scores in one process: run without torchrun, or score the saved weights "
                          "with scripts/eval_bench.py")
    from trainer.judge import lm_eval_scores  # lm-eval scoring: read by the runs that ask for it only
    try:
        lm_eval_scores.task_names(args.eval_bench, flag="--eval_bench")
        lm_eval_scores.import_lm_eval()
    except lm_eval_scores.BenchError as e:
        raise (TrainingHalted if e.code == 3 else ConfigError)(str(e)) from None
    include = args.eval_bench_include
    if include and not os.path.isdir(include):
        raise ConfigError(f"--eval_bench_include {include} is not a folder of lm-eval task YAML files")
    return os.path.abspath(include) if include else None


class Callbacks(list):
    """The callbacks of a run, called in order; also what the loop asks them (stop? save this step?)."""

    def call(self, hook, trainer, *args):
        for callback in self:
            method = getattr(callback, hook, None)
            if method is not None:
                method(trainer, *args)

    def stop_reason(self):
        """The first callback's reason to stop after this step, or None."""
        return next((cb.stop_reason for cb in self if getattr(cb, "stop_reason", None)), None)

    def wants_save(self, step):
        return any(getattr(cb, "save_step", None) == step for cb in self)

    def state_dict(self):
        return {name: cb.state_dict() for name, cb in self.named() if hasattr(cb, "state_dict")}

    def load_state_dict(self, state):
        for name, callback in self.named():
            if name in state and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(state[name])

    def named(self):
        """(name, callback): the class name, numbered when a class comes twice."""
        names = [type(cb).__name__ for cb in self]
        return [(n if names.count(n) == 1 else f"{n}_{names[:i].count(n)}", cb) for i, (n, cb) in
                enumerate(zip(names, self))]


def load_user_callbacks(specs):
    """The objects --callbacks names: FILE.py:NAME, a class made with no arguments, or an object."""
    callbacks = []
    for i, (path, name) in enumerate(specs):
        try:
            spec = importlib.util.spec_from_file_location(f"minimind_user_callbacks_{i}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file: its own error, in one line
            raise ConfigError(f"--callbacks {path}:{name}: the file raised {type(e).__name__}: {e}") from None
        if not hasattr(module, name):
            raise ConfigError(f"--callbacks {path}:{name}: the file defines no {name}")
        callback = getattr(module, name)
        callback = callback() if isinstance(callback, type) else callback
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise ConfigError(f"--callbacks {path}:{name} has none of {', '.join(HOOKS)}")
        callbacks.append(callback)
    return callbacks


def make_callbacks(plan):
    """The run's callbacks besides the sinks (the loop puts its Tracker first): early stopping, the best
    checkpoint, the per-rank log, then the user's."""
    callbacks, settings = Callbacks(), plan.callbacks
    callbacks.append(HealthWatch(plan.model.config.vocab_size, plan.io.metrics_file, plan.io.report,
                                 plan.io.run_dir + "_config.yaml"))  # health lines, the report at the end
    if plan.stage.demo_kind != "pretrain" and plan.data.eval_data_path:
        from trainer.judge import samples  # greedy samples at each eval: read by SFT and later stages only
        if samples.model_is_whole(plan.layout):
            callbacks.append(samples.Samples(plan.data.tokenizer_path, plan.io.metrics_file))
    if settings.early_stop_patience or settings.save_best:
        from trainer.runtime import eval_callbacks  # read by --early_stop_patience and --save_best runs only
        if settings.early_stop_patience:
            callbacks.append(eval_callbacks.EarlyStopping(settings.early_stop_patience, settings.early_stop_min_delta,
                                                          plan.schedule.eval_interval))
        if settings.save_best:
            callbacks.append(eval_callbacks.BestCheckpoint(plan.io.run_dir, plan.stage.best_weights_path(plan)))
    if plan.io.log_dir:
        callbacks.append(RankLog())
    if settings.eval_bench:
        from trainer.judge import lm_eval_scores  # lm-eval scoring: read by the runs that ask for it only
        try:
            tasks = lm_eval_scores.task_names(settings.eval_bench)
            callbacks.append(lm_eval_scores.EvalBench(tasks, settings.eval_bench_include, settings.eval_bench_limit,
                                                      settings.eval_bench_interval, plan.data.tokenizer_path))
        except lm_eval_scores.BenchError as e:
            raise (TrainingHalted if e.code == 3 else ConfigError)(str(e)) from None
    callbacks.extend(load_user_callbacks(settings.user))
    return callbacks
