"""Each rank's own files in a step directory, <name>_<rank>.pt of each per-rank part (trainer/ckpt/parts.py:
rng_<rank>.pt its RNG states, objective_<rank>.pt, powersgd_<rank>.pt), their one writer and reader.
"""
import os
import random

import numpy as np
import torch

from model.atomic import atomic_save
from trainer.base.launch import rank


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


def rank_file(path, name, rank_):
    """<path>/<name>_<rank>.pt: a per-rank part's file."""
    return os.path.join(path, f"{name}_{rank_}.pt")


def save_rank_state(path, name, state):
    """This rank's state of the per-rank part `name` into step directory `path`."""
    atomic_save(state, rank_file(path, name, rank()))


def read_rank_state(path, name, same_world):
    """The saved state of per-rank part `name`: this rank's file under the same number of processes, else rank 0's
    (RNG, and PowerSGD's step counter, are the same on every rank); None when that file is absent (the part had
    nothing to save). Written by this trainer with numpy RNG states inside: not a weights_only file."""
    file = rank_file(path, name, rank() if same_world else 0)
    return torch.load(file, weights_only=False) if os.path.isfile(file) else None
