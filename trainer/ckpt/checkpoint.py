"""The resume checkpoint, a DCP directory per save: its one writer (Checkpointer.save) and reader (read_resume before
the model is built, Checkpointer.load once it is wrapped; read_checkpoint_model / read_checkpoint_record for a step
directory named as weights).
  <checkpoint_dir>/<weight>_<hidden>[_moe]/step_<N>/
      __*.distcp, .metadata   model + optimizer (sharded_state_dict: FQN-keyed, DTensor shards stay shards)
      train_state.pt          rank 0: format_version, train_state (TrainState), scaler, world_size, global_batch,
                              layout, args (the flags as typed), config
      rng_<rank>.pt           each rank's own files (trainer/ckpt/rank_files.py): RNG states; the objective's state,
      objective_<rank>.pt       where it has one (GRPO: a rollout being reused); PowerSGD's residuals and Qs
      powersgd_<rank>.pt        (--grad_compression powersgd)
      complete.json           written last, by rank 0, once every rank's shards are written: only then it counts
DCP reshards on load, so a run may resume under another layout. The weights file: trainer/ckpt/weights_file.py.
MiniMind's own <checkpoint_dir>/<weight>_<hidden>[_moe]_resume.pth resumes when no directory checkpoint exists
(trainer/ckpt/minimind_resume.py).
"""
import json
import os
import re
import shutil
import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from model.atomic import atomic_json, atomic_save
from model.weight_shapes import WeightsError, clean_state_dict, config_fields
from trainer.ckpt.minimind_resume import minimind_resume_path, read_minimind_resume
from trainer.ckpt.rank_files import load_rank_files, save_rank_files
from trainer.ckpt.resume_fields import check_resume_fields, resume_fields
from trainer.ckpt.storage import check_room, disk_full_as_one_line, tree_bytes
from trainer.parallel.state_dict import (
    TIED_EMBEDDING,
    load_full_state,
    load_sharded_state,
    sharded_state_dict,
)
from trainer.runtime.launch import ConfigError, rank
from trainer.trainer_utils import Logger

# 1 and 2: one gathered file (read up to commit 4df0373); 3: a DCP directory per save
FORMAT_VERSION = 3
MANIFEST = "complete.json"
BEST_INDEX = "best.json"  # --save_best: the step whose checkpoint is kept whatever --keep_checkpoints says
# one process saves and loads without a process group, as intended: DCP warns about it on every save
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
CHECK_KEYS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "num_experts")


@dataclass
class TrainState:
    """Where training stands: what resume restores besides model, optimizer, scaler and RNG."""
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    tokens_seen: int = 0  # cumulative target tokens over all ranks
    tracker_id: Optional[str] = None

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def check_config(saved, config, path):
    """ConfigError naming the first model field the checkpoint was saved with differently."""
    for key in CHECK_KEYS:
        if saved.get(key) != getattr(config, key):
            raise ConfigError(f"{path} was saved with {key}={saved.get(key)} but this run has "
                              f"{key}={getattr(config, key)}; match the flags or pass --from_resume 0")




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


def _read_train_state(path, config):
    """train_state.pt of a complete DCP checkpoint, checked against this run's model (ConfigError if unusable)."""
    file = os.path.join(path, "train_state.pt")
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=False)
        saved, version = ckpt["config"], ckpt["format_version"]
    except Exception as e:
        raise ConfigError(f"{file} is not a readable checkpoint ({type(e).__name__}); "
                          f"delete {path} or pass --from_resume 0")
    if version != FORMAT_VERSION:
        raise ConfigError(f"{path} has checkpoint format {version}, this trainer reads {FORMAT_VERSION}; "
                          "update the code or pass --from_resume 0")
    check_config(saved, config, path)
    return dict(ckpt, dcp_path=path)


def saved_resume_fields(plan):
    """(path, resume fields) of the checkpoint --from_resume would load; (None, None) without one."""
    path = latest_checkpoint(plan.io.run_dir) if plan.io.from_resume != "0" else None
    try:
        return path, torch.load(os.path.join(path, "train_state.pt"), map_location="cpu",
                                weights_only=False).get("resume_fields") if path else None
    except Exception:
        return path, None  # read_resume names the unreadable file


def read_resume(config, plan):
    """--from_resume 1/auto, before the model is built: the newest complete checkpoint's own state (train_state.pt of
    a DCP directory, else MiniMind's resume file, whose model the plain model loads), checked against this run;
    Checkpointer.load restores it once the model is wrapped.

    None for --from_resume 0, or auto with nothing to resume; --from_resume 1 with nothing is a ConfigError.
    Its global batch must match this run's.
    """
    if plan.io.from_resume == "0":
        return None
    path = plan.io.resume_path or latest_checkpoint(plan.io.run_dir)  # --from_resume <step dir>: that one
    minimind_path = minimind_resume_path(plan.io.checkpoint_dir, os.path.basename(plan.io.run_dir))
    ckpt = _read_train_state(path, config) if path else \
        read_minimind_resume(minimind_path, config, plan) if os.path.isfile(minimind_path) else None
    if ckpt is None:
        if plan.io.from_resume == "1":
            raise ConfigError(f"--from_resume 1 but {plan.io.run_dir} holds no complete checkpoint; pass --from_resume "
                              "auto to start fresh when there is none, or 0")
        Logger(f"--from_resume auto: no complete checkpoint in {plan.io.run_dir}, starting fresh")
        return None
    check_resume_fields(ckpt.get("resume_fields"), plan, path or minimind_path)
    if ckpt["global_batch"] != plan.data.global_batch:
        raise ConfigError(f"checkpoint was saved with a global batch of {ckpt['global_batch']} samples, this run "
                          f"has {plan.data.global_batch} (batch_size x accumulation_steps x dp); match it to resume "
                          "exactly")
    Logger(f"Resuming from {path or minimind_path}")
    return ckpt


def read_checkpoint_model(path):
    """(state_dict, config fields, typed args) of a step directory's model, whatever layout saved it: the full
    tensors from every rank's shards, in this one process (eval_llm --checkpoint, convert_model, --from_weight)."""
    try:
        reader = FileSystemReader(path)
        model = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)  # saved as {"model": ...}
                 for key, meta in reader.read_metadata().state_dict_metadata.items()
                 if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
        saved = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"{path} is not a readable resume checkpoint ({type(e).__name__}); pass a complete "
                           "step_<N> directory, a .pth or an HF folder") from None
    return clean_state_dict(model), config_fields(saved["config"]), saved.get("args")


def read_checkpoint_record(path):
    """What a step directory records besides the model: {"tokenizer": {"path", "sha256"} (older ones: the typed
    --tokenizer_path only), "step": N}; {} when train_state.pt is unreadable (read_checkpoint_model names it)."""
    try:
        saved = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
    except Exception:
        return {}
    tokenizer = saved.get("tokenizer") or {"path": (saved.get("args") or {}).get("tokenizer_path"), "sha256": None}
    return {"tokenizer": tokenizer if tokenizer["path"] else None,
            "step": (saved.get("train_state") or {}).get("global_step")}


def tied_aliases(pipeline, config):
    """Under pp the tied embedding has a copy on the last stage; its optimizer state is saved once."""
    return TIED_EMBEDDING if pipeline is not None and config.tie_word_embeddings else None


class Checkpointer:
    """Writes resume checkpoints of its stateful parts, one DCP directory per save; keeps the newest `keep` complete
    ones (0: all). `parts`: model_parts, optimizer, scaler, progress (TrainState), objective (its per-rank
    state_dict), tied (aliases or None), and the plan and config recorded beside them.

    With async_save, dcp.async_save writes in a thread over its own gloo group while training goes on; the next
    save, and the end of the run (wait), wait for it. A save counts once rank 0 has written its manifest.
    """

    def __init__(self, run_dir, async_save=False, keep=3, parts=None, estimate=0):
        self.run_dir, self.async_save, self.keep, self.parts = run_dir, async_save, keep, parts
        self.pending = None  # (future, manifest-written event) of the async save in flight
        self.needed, self.last = estimate, None  # bytes a save takes (the last one's, else the estimate); last one
        # a separate group, so the writer thread's collectives never interleave with training's (a collective)
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def save(self, step):
        """Write step `step`'s checkpoint (a collective); returns once it is written, or staged under async_save.

        A disk without room for it (the last checkpoint's size), or one that fills during the write, ends the run
        with one line naming the directory, the space needed and free, and the last complete checkpoint."""
        self.wait()
        path = os.path.join(self.run_dir, f"step_{step}")
        self.last = latest_checkpoint(self.run_dir)
        self.needed = tree_bytes(self.last) if self.last else self.needed
        check_room(self.run_dir, self.needed, self.last)  # a collective: every rank stops together
        with disk_full_as_one_line(self.run_dir, self.needed, self.last, partial=path):
            self.save_files(path)

    def load(self, ckpt):
        """Restore the parts from read_resume's `ckpt`: model and optimizer from the DCP shards, resharded into this
        layout (MiniMind's file: its optimizer; its model was loaded before parallelizing), scaler, RNG (the same
        rank's file when the world size matches, else rank 0's), objective, TrainState and callbacks."""
        parts = self.parts
        if "dcp_path" in ckpt:
            load_sharded_state(parts["model_parts"], parts["optimizer"], ckpt["dcp_path"], tied_aliases=parts["tied"])
            same_world = ckpt["world_size"] == parts["plan"].layout.world_size  # else every rank takes rank 0's
            load_rank_files(ckpt["dcp_path"], parts["objective"], parts["model_parts"], same_world)
        else:  # MiniMind's resume file: no RNG state
            load_full_state(parts["model_parts"], [parts["optimizer"]], None, ckpt["optimizer"],
                            tied_aliases=parts["tied"])
        parts["scaler"].load_state_dict(ckpt["scaler"])
        parts["progress"].load_state_dict(ckpt["train_state"])
        parts["callbacks"].load_state_dict(ckpt.get("callbacks", {}))  # early stopping, best checkpoint, a user's

    def save_files(self, path):
        """train_state.pt (rank 0), this rank's RNG file and its DCP shards into `path`."""
        if rank() == 0 and os.path.exists(os.path.join(path, MANIFEST)):
            os.remove(os.path.join(path, MANIFEST))  # rewriting a step: it is incomplete until written again
        if dist.is_initialized():
            dist.barrier()
        parts = self.parts
        if rank() == 0:
            atomic_save(self.train_state(), os.path.join(path, "train_state.pt"))
        save_rank_files(path, parts["objective"], parts["model_parts"])
        state = sharded_state_dict(parts["model_parts"], parts["optimizer"], parts["tied"])
        if not self.async_save:
            self.write(state, path)
            return
        # FileSystemWriter stages (copies into new CPU buffers) before returning: training may then update the weights
        response = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        # newer torch may return an AsyncSaveResponse
        future, marked = getattr(response, "upload_completion", response), threading.Event()
        if rank() == 0:
            def on_done(f):  # rank 0's save finishes only once every rank's write result reached it
                try:
                    if f.exception() is None:
                        self.mark_complete(path)
                finally:
                    marked.set()
            future.add_done_callback(on_done)
        self.pending = (future, marked)

    def write(self, state, path):
        """The synchronous save: shards, then a barrier, then rank 0's manifest."""
        dcp.save(state, checkpoint_id=path)
        if dist.is_initialized():
            dist.barrier()  # every rank's shards and RNG file are on disk
        if rank() == 0:
            self.mark_complete(path)

    def train_state(self):
        """What rank 0 writes beside the shards: progress, scaler, layout, the typed flags and the model config."""
        parts, plan = self.parts, self.parts["plan"]
        layout = plan.layout
        return dict(train_state=parts["progress"].state_dict(), scaler=parts["scaler"].state_dict(),
                    world_size=layout.world_size, global_batch=plan.data.global_batch,
                    layout=dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, zero_stage=layout.zero_stage),
                    args=dict(plan.flags), config=parts["config"].to_dict(), format_version=FORMAT_VERSION,
                    tokenizer=plan.data.tokenizer_record, resume_fields=resume_fields(plan),
                    callbacks=parts["callbacks"].state_dict())

    def wait(self):
        """Wait for the pending async save (its manifest included); re-raises its error."""
        if self.pending is None:
            return
        future, marked = self.pending
        self.pending = None
        with disk_full_as_one_line(self.run_dir, self.needed, self.last):
            future.result()
        if rank() == 0:
            marked.wait()

    def mark_complete(self, path):
        """Rank 0, once every rank's files are written: the manifest, last; then prune."""
        step = int(path.rsplit("_", 1)[1])
        atomic_json(dict(step=step, format_version=FORMAT_VERSION), os.path.join(path, MANIFEST))
        self.prune(step)

    def prune(self, step):
        """Drop steps after `step` (an abandoned timeline), partial saves before it, complete ones past `keep`."""
        best = best_checkpoint_step(self.run_dir)  # --save_best's, on this timeline (before `step`): never pruned
        older = [(s, p, done) for s, p, done in checkpoints(self.run_dir)
                 if s != step and not (s == best < step and done)]
        kept = [p for s, p, done in older if done and s < step][-(self.keep - 1):] if self.keep > 1 else []
        for s, p, done in older:
            if p not in kept and (self.keep or s > step or not done):
                shutil.rmtree(p, ignore_errors=True)
