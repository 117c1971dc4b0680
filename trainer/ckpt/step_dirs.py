"""A run's step directories (<checkpoint_dir>/<run>/step_<N>): which exist and which are complete, train_state.pt's one
reader, and the two rules across ranks: a step is marked complete only when every rank's files are there as the
marking rank sees them (unseen_files), and every rank resumes from the same step, the newest all of them have
(agreed_checkpoint). Nodes that do not share the checkpoint directory break both; each says so in one line. Each
rank's own files in a step directory (<name>_<rank>.pt) are written and read here too (the end of this file).

complete.json records every file's size and crc32; a step is loaded only once both match (damage): sizes on every
rank, contents read once between the ranks (content_share). crc32, not a cryptographic hash: the sums sit unsigned
beside the files, so whoever can change a shard can change them too; what they guard against is damage (a flipped
byte, a torn copy), which crc32 finds as surely (every burst up to 32 bits) at 3x sha256's speed on SHA-NI hardware.
"""
import json
import os
import random
import re
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from model.atomic import atomic_save
from model.errors import ConfigError
from trainer.base import launch
from trainer.base.launch import rank
from trainer.base.log import Logger

# 1 and 2: one gathered file (read up to commit 4df0373); 3: a DCP directory per save. It names the layout only:
# the parts are versioned by key (train_state.pt "parts", trainer/ckpt/parts.py), so a new part does not change it
FORMAT_VERSION = 3
MANIFEST = "complete.json"
TRAIN_STATE = "train_state.pt"
BEST_INDEX = "best.json"  # --save_best: the step whose checkpoint is kept whatever --keep_checkpoints says
SHOWN_RANKS = 4  # ranks named in a disagreement line
CRC_FILE = "crc32_{rank}.json"  # each rank's crc32 of the shards it wrote, taken as they were written
CRC_CHUNK = 8 << 20  # bytes per read of a file being summed


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


def file_sizes(path):
    """{name: bytes} of every file of step directory `path` but the manifest: what the manifest records at save and
    damage() checks at load."""
    names = sorted(name for name in os.listdir(path) if name != MANIFEST and os.path.isfile(os.path.join(path, name)))
    return {name: os.path.getsize(os.path.join(path, name)) for name in names}


def file_crc(path):
    """crc32 of the file at `path`, in one streamed read."""
    crc, buffer = 0, bytearray(CRC_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)


def content_share(sizes, rank_, ranks):
    """The files (of {name: bytes}) whose contents rank `rank_` of `ranks` checks: largest first, each to the rank
    with the fewest bytes so far, so that the ranks read a step once between them."""
    loads, mine = [0] * ranks, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        chosen = loads.index(min(loads))
        loads[chosen] += sizes[name]
        if chosen == rank_:
            mine.append(name)
    return mine


def record_crcs(path):
    """{name: crc32 as 8 hex digits} of every file of step directory `path` but the manifest, for the manifest: each
    rank's shards as it wrote them (its CRC_FILE), the rest (.metadata, train_state.pt, the per-rank files) read now."""
    sums = {}
    for name in os.listdir(path):
        if re.fullmatch(CRC_FILE.format(rank=r"\d+"), name):
            with open(os.path.join(path, name)) as f:
                sums.update(json.load(f))
    return {name: sums.get(name) or f"{file_crc(os.path.join(path, name)):08x}" for name in file_sizes(path)}


def damage(path, contents=(0, 1)):
    """Why complete step directory `path` cannot be loaded ('<file>: <why>'), None when it can: every file its manifest
    records has its recorded size, every shard file .metadata names is there and holds the bytes it names (manifests
    written before sizes were recorded get these checks only), .metadata and train_state.pt parse, and the files of
    this rank's share have their recorded crc32. `contents`: (this rank, ranks) sharing that read (content_share;
    None: no contents read); manifests written before crc32 was recorded skip it."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        recorded, crcs = manifest.get("files") or {}, manifest.get("crc32") or {}
    except (OSError, ValueError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    why = _size_damage(path, recorded)
    if why or contents is None:
        return why
    for name in content_share({name: recorded.get(name, 0) for name in crcs}, *contents):
        have = f"{file_crc(os.path.join(path, name)):08x}"
        if have != crcs[name]:
            return f"{name} holds other bytes than were written (crc32 {have}, {crcs[name]} recorded)"
    return None


def _size_damage(path, recorded):
    """damage's checks of sizes and parses, from the manifest's recorded sizes."""
    for name, size in recorded.items():
        have = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if have != size:
            return f"{name} is missing" if have is None else f"{name} holds {have} bytes, {size} were written"
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:
        return f".metadata is unreadable ({type(e).__name__})"
    ends = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        have = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if have is None or have < end:
            return f"{name} is missing" if have is None else f"{name} holds {have} bytes, .metadata names {end}"
    try:
        load_train_state(path)
    except Exception as e:
        return f"{TRAIN_STATE} is unreadable ({type(e).__name__})"
    return None


def loadable_checkpoint(run_dir):
    """The newest complete step directory of `run_dir` whose sizes and parses hold (damage without reading contents,
    which read_resume does), or None."""
    for _, path, done in reversed(checkpoints(run_dir)):
        if done and damage(path, contents=None) is None:
            return path
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


def every_rank(value):
    """[each rank's `value`] in rank order (a collective under a process group; [value] without one)."""
    if not dist.is_initialized():
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value, group=launch.CPU_GROUP)
    return every


def agreed_damage(path):
    """damage() of step directory `path` as the ranks see it together (a collective under a process group): each rank
    checks the sizes and its share of the contents; the first rank's why, None when every rank finds none."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return next((why for why in every_rank(damage(path, (rank(), ranks))) if why), None)


def agreed_checkpoint(run_dir):
    """The newest complete step directory every rank has and can load (a collective under a process group), None when
    none has any: the ranks walk their common complete steps from the newest, and a step damaged as any rank sees it
    (agreed_damage) is skipped with a note; when every complete step is damaged that is one line; ranks that hold
    checkpoints but none in common stop, each with the same one line."""
    mine = [step for step, _, done in checkpoints(run_dir) if done]
    every = every_rank(mine)
    common = sorted(set(every[0]).intersection(*every[1:]))
    newest, skipped = common[-1] if common else None, []
    while common and (why := agreed_damage(os.path.join(run_dir, f"step_{common[-1]}"))):
        skipped.append(f"step {common[-1]} ({os.path.join(run_dir, f'step_{common.pop()}', why)})")
    if skipped and not common:
        raise ConfigError(f"no complete checkpoint in {run_dir} loads: {'; '.join(skipped)}; delete the damaged step "
                          "directories, or pass --from_resume 0 --overwrite 1 to start over")
    if skipped:
        Logger(f"note: skipped {'; '.join(skipped)}: resuming from step {common[-1]}, the newest complete step that "
               "loads")
    if common:
        if mine[-1] != newest:
            Logger(f"note: not every rank has step {mine[-1]}; resuming from step {common[-1]}, the newest all have")
        return os.path.join(run_dir, f"step_{common[-1]}")
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


# ----------------------------------------------------------------------------- each rank's own files
# <name>_<rank>.pt of each per-rank part (trainer/ckpt/parts.py): rng_<rank>.pt its RNG states, objective_<rank>.pt,
# powersgd_<rank>.pt; their one writer and reader
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
