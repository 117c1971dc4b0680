"""Checkpoints: atomic writes, the resume file, the TrainState counters, MiniMind's lm_checkpoint.

Two files per save, written by rank 0 after a collective gather:
  <save_dir>/<weight>_<hidden>[_moe].pth              plain full state dict in --save_dtype (MiniMind's weights)
  <checkpoint_dir>/<weight>_<hidden>[_moe]_resume.pth  resume state, fp32, keyed by parameter FQN:
      format_version, model (full state dict), optimizer (full, FQN-keyed), scaler, rng, train_state
      (TrainState.state_dict()), world_size, global_batch, args (the flags as typed), config
Full (gathered) states load into any layout, so a run may resume under another one.
"""
import os
import random
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from trainer.parallel.state_dict import TIED_EMBEDDING, full_model_state_dict, full_optimizer_state_dict, load_full_state
from trainer.trainer_utils import ConfigError, is_main_process, repo_path, weight_name

# 1: flat counters (epoch, step_in_epoch, global_step, tokens_seen, tracker_id); 2: a train_state dict
FORMAT_VERSION = 2
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


def atomic_save(obj, path):
    """torch.save to a temporary file, fsync, then rename: a killed save never leaves a valid-looking file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_path(config, weight="pretrain", save_dir="checkpoints"):
    return os.path.join(repo_path(save_dir), weight_name(weight, config) + "_resume.pth")


def upgrade(ckpt, path):
    """The checkpoint in the current format, or ConfigError naming its version when it cannot be read."""
    version = ckpt.get("format_version", 0)
    if version > FORMAT_VERSION:
        raise ConfigError(f"{path} has checkpoint format {version}, newer than this trainer's {FORMAT_VERSION}; "
                          "update the code or pass --from_resume 0")
    if version == FORMAT_VERSION:
        return ckpt
    missing = [k for k in ("epoch", "step_in_epoch", "global_step", "tokens_seen") if k not in ckpt]
    if missing:
        raise ConfigError(f"{path} has checkpoint format {version} without {', '.join(missing)} (written by an "
                          f"older trainer); resume it with that commit or pass --from_resume 0")
    state = TrainState(ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"], ckpt["tokens_seen"],
                       ckpt.get("tracker_id"))
    return dict(ckpt, train_state=state.state_dict(), format_version=FORMAT_VERSION)


def lm_checkpoint(config, weight="pretrain", state=None, save_dir="checkpoints"):
    """MiniMind's entry point: save `state` (a dict) atomically, or load, check and upgrade it.

    Load returns None when no checkpoint exists; raises ConfigError naming the file and the mismatch
    when it is corrupt, of an unreadable format, or was written for a different model.
    """
    path = resume_path(config, weight, save_dir)
    if state is not None:
        atomic_save(dict(state, config=config.to_dict(), format_version=FORMAT_VERSION), path)
        return path
    if not os.path.exists(path):
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        saved = ckpt["config"]
    except Exception as e:
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it or pass --from_resume 0")
    for key in CHECK_KEYS:
        if saved.get(key) != getattr(config, key):
            raise ConfigError(f"{path} was saved with {key}={saved.get(key)} but this run has "
                              f"{key}={getattr(config, key)}; match the flags or pass --from_resume 0")
    return upgrade(ckpt, path)


def load_resume(config, plan, args):
    """The resume checkpoint when --from_resume 1 (else None); its global batch must match this run's."""
    if not args.from_resume:
        return None
    ckpt = lm_checkpoint(config, weight=args.save_weight, save_dir=plan.checkpoint_dir)
    if ckpt is not None and ckpt["global_batch"] != plan.global_batch:
        raise ConfigError(f"checkpoint was saved with a global batch of {ckpt['global_batch']} samples, this run "
                          f"has {plan.global_batch} (batch_size x accumulation_steps x dp); match it to resume exactly")
    return ckpt


def tied_aliases(pipeline, config):
    """Under pp the tied embedding has a copy on the last stage; its optimizer state is saved once."""
    return TIED_EMBEDDING if pipeline is not None and config.tie_word_embeddings else None


def restore(trainer, ckpt):
    """Load optimizer, scaler, RNG and TrainState from `ckpt` (the model was loaded before parallelizing)."""
    load_full_state(trainer.model_parts, [trainer.optimizer], None, ckpt["optimizer"],
                    tied_aliases=tied_aliases(trainer.pipeline, trainer.config))
    trainer.scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    trainer.progress.load_state_dict(ckpt["train_state"])


def save_checkpoint(trainer):
    """Gather the full state (collective) and write weights + resume file on rank 0; every rank waits."""
    pp_group = trainer.dims.group("pp") if trainer.plan.pp > 1 else None
    model_sd = full_model_state_dict(trainer.model_parts, pp_group=pp_group)
    optim_sd = full_optimizer_state_dict(trainer.model_parts, [trainer.optimizer], pp_group=pp_group,
                                         tied_aliases=tied_aliases(trainer.pipeline, trainer.config))
    if is_main_process():
        args, config = trainer.args, trainer.config
        save_dtype = getattr(torch, args.save_dtype)
        weights = {k: v.to(save_dtype) for k, v in model_sd.items()}
        atomic_save(weights, os.path.join(trainer.plan.save_dir, weight_name(args.save_weight, config) + ".pth"))
        state = dict(model=model_sd, optimizer=optim_sd, scaler=trainer.scaler.state_dict(), rng=rng_state(),
                     train_state=trainer.progress.state_dict(), world_size=trainer.plan.world_size,
                     global_batch=trainer.plan.global_batch, args=vars(args).copy())
        lm_checkpoint(config, weight=args.save_weight, state=state, save_dir=trainer.plan.checkpoint_dir)
    if dist.is_initialized():
        dist.barrier()
