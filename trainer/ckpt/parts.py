"""A checkpoint's stateful parts by registry: each part registers once with its scope, and Checkpointer.save and
.load (trainer/ckpt/resume.py) walk the registry. Adding a part is one registration (docs/checkpoints.md).

Scopes, and where a part's state lies in a step directory:
  sharded   DCP shards (__*.distcp, .metadata): state() returns top-level DCP entries; load(ckpt) reads them
  rank 0    one key of train_state.pt, written by rank 0: state() / load(state)
  per rank  <name>_<rank>.pt, each rank its own: state() (None: nothing to save this time) / load(state, same_world),
            the state being this rank's file under the same number of processes, else rank 0's

Checkpoints list the parts they hold (train_state.pt "parts"); one saved before that held LEGACY_PARTS. A part that a
checkpoint lacks starts from its start value with a one-line note, or, when it has none (`start` None), the
checkpoint is refused in one line: it cannot be continued exactly.
"""
from dataclasses import dataclass
from typing import Callable, Optional

from model.errors import ConfigError
from trainer.base.log import Logger
from trainer.ckpt.step_dirs import rng_state, set_rng_state
from trainer.parallel.state_dict import load_full_state, load_sharded_state, sharded_state_dict

SHARDED, RANK0, PER_RANK = "sharded", "rank 0", "per rank"
# what every checkpoint held before checkpoints listed their parts
LEGACY_PARTS = ("model", "rng", "objective", "powersgd", "scaler", "train_state", "callbacks")


@dataclass
class Part:
    """One stateful part of the resume checkpoint (see the module docstring for state/load by scope).

    start: what the part starts from when a checkpoint lacks it (the one-line note); None: such a checkpoint cannot
    be continued exactly and is refused. begin: sets that start value, once the saved parts are restored (None: the
    part keeps the value it has)."""
    name: str
    scope: str
    state: Callable
    load: Callable
    start: Optional[str] = None
    begin: Optional[Callable] = None


def missing_parts_line(path, saved, registered):
    """The refusal of a checkpoint that lacks a part without a start value, else None; the parts that start from
    their start value are noted."""
    for part in registered:
        if part.name not in saved and part.start is None:
            return (f"{path} holds no '{part.name}' state (saved before that part existed) and it has no start "
                    "value, so the run cannot continue exactly; resume with the trainer that saved it, or pass "
                    "--from_resume 0 --overwrite 1 to start over")
    for part in registered:
        if part.name not in saved:
            Logger(f"note: {path} holds no '{part.name}' state (saved before that part existed); {part.start}")
    return None


def note_unused_parts(path, saved, registered):
    """Saved parts this run registers none for (a stage's part, run without it): said, not restored."""
    names = {part.name for part in registered}
    for name in saved:
        if name not in names:
            Logger(f"note: {path} holds '{name}' state that this run does not use; it is not restored")


def model_part(model_parts, optimizer, tied):
    """Model weights and optimizer state together: the optimizer's state is keyed by the model's names, and a
    pipeline's tied embedding saves its state once (`tied`), so one DCP load restores both."""
    def load(ckpt):
        if "dcp_path" in ckpt:
            load_sharded_state(model_parts, optimizer, ckpt["dcp_path"], tied_aliases=tied)
        else:  # MiniMind's resume file: its optimizer (its model was loaded before parallelizing)
            load_full_state(model_parts, [optimizer], None, ckpt["optimizer"], tied_aliases=tied)
    return Part("model", SHARDED, lambda: sharded_state_dict(model_parts, optimizer, tied), load)


def rng_part():
    """Each rank's RNG states (under another number of processes every rank takes rank 0's)."""
    return Part("rng", PER_RANK, rng_state, lambda state, same_world: set_rng_state(state))


def objective_part(objective):
    """The objective's per-rank state where it has one (GRPO: a rollout being reused): this rank's data, so it
    continues only under the same number of processes."""
    def load(state, same_world):
        if not same_world:
            raise ConfigError("the checkpoint holds per-rank objective state (a rollout being reused) saved with "
                              "another number of processes; resume with the same number, or from a step where no "
                              "rollout is reused")
        objective.load_state_dict(state)
    return Part("objective", PER_RANK, lambda: objective.state_dict() or None, load)


def comm_hooks(model_parts):
    """The resumable (PowerSGD) hooks of the DDP-wrapped parts (one per pipeline stage this rank holds), in part
    order: parallel/data.py sets `comm_hook` on those only."""
    return [part.comm_hook for part in model_parts if getattr(part, "comm_hook", None) is not None]


def powersgd_part(model_parts):
    """Each PowerSGD hook's state (--grad_compression powersgd): residuals and Qs by parameter, the step counter.
    The residuals are this rank's own: under another number of processes only the step counter and the generator of
    first Qs carry over (rank 0's; they are the same on every rank)."""
    def state():
        hooks = comm_hooks(model_parts)
        return [hook.state_dict() for hook in hooks] if hooks else None

    def load(saved, same_world):
        hooks = comm_hooks(model_parts)
        if not hooks:
            return
        if not same_world:
            Logger("note: PowerSGD's error-feedback residuals are per process: this resume under another number of "
                   "processes starts them at zero (its step counter carries over)")
            saved = [dict(hook_state, pieces={}) for hook_state in saved]
        for hook, hook_state in zip(hooks, saved):
            hook.load_state_dict(hook_state)
    return Part("powersgd", PER_RANK, state, load)


def standard_parts(model_parts, optimizer, tied, scaler, progress, objective, callbacks):
    """The parts every stage's checkpoint holds, in the order they are restored: model + optimizer (sharded), RNG,
    objective and PowerSGD (per rank), scaler, progress (TrainState) and callbacks (rank 0)."""
    return [model_part(model_parts, optimizer, tied), rng_part(), objective_part(objective), powersgd_part(model_parts),
            Part("scaler", RANK0, scaler.state_dict, scaler.load_state_dict),
            Part("train_state", RANK0, progress.state_dict, progress.load_state_dict),
            Part("callbacks", RANK0, callbacks.state_dict, callbacks.load_state_dict, start="callbacks start fresh")]
