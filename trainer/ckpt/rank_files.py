"""Each rank's own files in a checkpoint's step directory, their one writer and reader (trainer/ckpt/checkpoint.py calls
them): rng_<rank>.pt (its RNG states), objective_<rank>.pt (the objective's state where it has one: GRPO's rollout
being reused) and powersgd_<rank>.pt (--grad_compression powersgd: residuals and Qs by parameter, the step counter).
"""
import os
import random

import numpy as np
import torch

from model.atomic import atomic_save
from trainer.parallel.powersgd import comm_hooks
from trainer.runtime.launch import ConfigError, rank
from trainer.trainer_utils import Logger


def rng_state():
    """This rank's RNG states; CUDA's of its current device only, so a run resumes on fewer visible GPUs."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # earlier checkpoints held every visible GPU's (get_rng_state_all)
            device = torch.cuda.current_device()
            cuda = cuda[device] if device < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)  # the current device: init_distributed_mode set it to the local rank


def objective_file(path, rank_):
    return os.path.join(path, f"objective_{rank_}.pt")


def restore_objective(objective, path, same_world):
    """An objective's saved state (e.g. GRPO's rollout in reuse); it is this rank's data, so only in the same world."""
    file = objective_file(path, rank())
    if os.path.isfile(file) and not same_world:
        raise ConfigError(f"{path} holds per-rank objective state (a rollout being reused) saved with another number "
                          "of processes; resume with the same number, or from a step where no rollout is reused")
    if os.path.isfile(file):
        objective.load_state_dict(torch.load(file, weights_only=False))


def powersgd_file(path, rank_):
    return os.path.join(path, f"powersgd_{rank_}.pt")


def restore_powersgd(model_parts, path, same_world):
    """Each PowerSGD hook's saved state. Its residuals are this rank's own: under another number of processes only
    the step counter and the generator of first Qs carry over (rank 0's; they are the same on every rank)."""
    hooks = comm_hooks(model_parts)
    file = powersgd_file(path, rank() if same_world else 0)
    if not hooks or not os.path.isfile(file):
        return
    saved = torch.load(file, weights_only=False)
    if not same_world:
        Logger("note: PowerSGD's error-feedback residuals are per process: this resume under another number of "
               "processes starts them at zero (its step counter carries over)")
        saved = [dict(state, pieces={}) for state in saved]
    for hook, state in zip(hooks, saved):
        hook.load_state_dict(state)


def save_rank_files(path, objective, model_parts):
    """This rank's RNG states, its objective's state (if any) and its PowerSGD hooks' states (if any) into `path`."""
    atomic_save(rng_state(), os.path.join(path, f"rng_{rank()}.pt"))
    objective_state = objective.state_dict()
    if objective_state:
        atomic_save(objective_state, objective_file(path, rank()))
    if comm_hooks(model_parts):
        atomic_save([hook.state_dict() for hook in comm_hooks(model_parts)], powersgd_file(path, rank()))


def load_rank_files(path, objective, model_parts, same_world):
    """The RNG states (this rank's file under the same world size, else rank 0's), the objective's and PowerSGD's."""
    set_rng_state(torch.load(os.path.join(path, f"rng_{rank() if same_world else 0}.pt"), weights_only=False))
    restore_objective(objective, path, same_world)
    restore_powersgd(model_parts, path, same_world)
