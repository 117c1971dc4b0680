"""A run's step directories (<checkpoint_dir>/<run>/step_<N>): which exist and which are complete, train_state.pt's one
reader, and the two rules across ranks: a step is marked complete only when every rank's files are there as the
marking rank sees them (unseen_files), and every rank resumes from the same step, the newest all of them have
(agreed_checkpoint). Nodes that do not share the checkpoint directory break both; each says so in one line.
"""
import json
import os
import re

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from trainer.base import launch
from trainer.base.errors import ConfigError
from trainer.base.log import Logger
from trainer.ckpt.rank_files import rank_file

# 1 and 2: one gathered file (read up to commit 4df0373); 3: a DCP directory per save. It names the layout only:
# the parts are versioned by key (train_state.pt "parts", trainer/ckpt/parts.py), so a new part does not change it
FORMAT_VERSION = 3
MANIFEST = "complete.json"
TRAIN_STATE = "train_state.pt"
BEST_INDEX = "best.json"  # --save_best: the step whose checkpoint is kept whatever --keep_checkpoints says
SHOWN_RANKS = 4  # ranks named in a disagreement line


def checkpoints(run_dir):
    """[(step, directory, complete)] of a run's step_<N> directories, oldest first."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        match = re.fullmatch(r"step_(\d+)", name)
        if match:
            path = os.path.join(run_dir, name)
            found.append((int(match.group(1)), path, os.path.isfile(os.path.join(path, MANIFEST))))
    return sorted(found)


def best_checkpoint_step(run_dir):
    """The step best.json names (--save_best), or None."""
    try:
        with open(os.path.join(run_dir, BEST_INDEX)) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return None


def latest_checkpoint(run_dir):
    """The newest complete step directory of `run_dir`, or None."""
    complete = [path for _, path, done in checkpoints(run_dir) if done]
    return complete[-1] if complete else None


def load_train_state(path):
    """train_state.pt of step directory `path`, its one reader. It holds plain data (numbers, strings, lists, dicts,
    tensors), so it loads weights_only; the callers say what an unreadable one means to them."""
    return torch.load(os.path.join(path, TRAIN_STATE), map_location="cpu", weights_only=True)


def unseen_files(path, world_size):
    """The files of step directory `path` that its ranks wrote and this process does not see: each rank's RNG file
    (every rank writes one) and every shard file DCP's metadata names."""
    names = [os.path.basename(rank_file(path, "rng", r)) for r in range(world_size)]
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
        names += sorted({info.relative_path for info in storage.values()})
    except Exception:  # no readable .metadata: the coordinator's file is missing
        names.append(".metadata")
    return [name for name in names if not os.path.isfile(os.path.join(path, name))]


def incomplete_line(path, world_size):
    """The refusal to mark `path` complete when some rank's files are not there, else None."""
    unseen = unseen_files(path, world_size)
    if not unseen:
        return None
    shown = ", ".join(unseen[:6]) + (f" and {len(unseen) - 6} more" if len(unseen) > 6 else "")
    return (f"{path} lacks files other ranks wrote ({shown}): its checkpoint cannot be marked complete; every node "
            "must see one --checkpoint_dir (a shared filesystem), or train on one node")


def agreed_checkpoint(run_dir):
    """The newest complete step directory every rank has (a collective under a process group), None when none has
    any; ranks that hold checkpoints but none in common stop, each with the same one line."""
    mine = [step for step, _, done in checkpoints(run_dir) if done]
    if not dist.is_initialized():
        return os.path.join(run_dir, f"step_{mine[-1]}") if mine else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=launch.CPU_GROUP)
    common = set(every[0]).intersection(*every[1:])
    if common:
        if mine and max(common) != mine[-1]:
            Logger(f"note: not every rank has step {mine[-1]}; resuming from step {max(common)}, the newest all have")
        return os.path.join(run_dir, f"step_{max(common)}")
    if not any(every):
        return None
    seen = "; ".join(f"rank {r}: {', '.join(map(str, steps)) or 'none'}" for r, steps in enumerate(every[:SHOWN_RANKS]))
    error = ConfigError(f"the ranks hold no complete checkpoint in common in {run_dir} (steps {seen}): every node "
                        "must see one --checkpoint_dir (a shared filesystem); or --from_resume 0 --overwrite 1")
    error.every_rank = True  # each rank's own view: every console shows it
    raise error


def minimind_resume_path(checkpoint_dir, stem):
    """Where MiniMind's lm_checkpoint keeps the resume file of weights `stem` (<weight>_<hidden>[_moe]); read by
    trainer/ckpt/minimind_resume.py, which a run loads only when that file is there."""
    return os.path.join(checkpoint_dir, stem + "_resume.pth")
