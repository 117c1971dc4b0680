"""MiniMind's small helpers: paths, logging, lr schedule, weight names, the resume sampler, lm_checkpoint (init_model,
MiniMind's model init, is in trainer/ckpt/weights_file.py with the other weights readers)."""
import os

import torch
import torch.distributed as dist

from model.atomic import atomic_save
from model.weights.files import save_weights_file
from model.weights.paths import ROOT, file_digest, repo_path, typed_or_default, weight_name
from trainer.base.log import Logger, say
from trainer.ckpt import minimind_resume
from trainer.ckpt.step_dirs import minimind_resume_path
from trainer.core.data_loading import SkipBatchSampler
from trainer.runtime.schedule import MINIMIND_FLOOR, LRSchedule, lr_at

# MiniMind's helper names, kept here for scripts written against MiniMind (they live on the floors that use them)
__all__ = ["ROOT", "Logger", "SkipBatchSampler", "file_digest", "get_lr", "lm_checkpoint", "repo_path", "say",
           "typed_or_default", "weight_name"]


def get_lr(current_step, total_steps, lr, warmup_steps=0):
    """MiniMind's cosine schedule lr*(0.1+0.45*(1+cos(pi*t/T))), after an optional linear warm-up (schedule.py)."""
    return lr_at(LRSchedule("cosine", lr, MINIMIND_FLOOR, warmup_steps, 0.1, 0), current_step, total_steps)


def _unwrapped(module):
    """The module inside DDP (.module) and torch.compile (._orig_mod), as MiniMind saves it."""
    module = getattr(module, "module", module)
    return getattr(module, "_orig_mod", module)


def _tracker_id(wandb):
    """The run id of MiniMind's `wandb` argument (a swanlab/wandb module with get_run(), or a run), else None."""
    if not wandb:
        return None
    if hasattr(wandb, "get_run"):
        run = wandb.get_run()
        return getattr(run, "id", None) if run else None
    return getattr(wandb, "id", None)


def lm_checkpoint(lm_config, weight="full_sft", model=None, optimizer=None, epoch=0, step=0, wandb=None,
                  save_dir="../checkpoints", **kwargs):
    """MiniMind's lm_checkpoint. Given a model: save <save_dir>/<weight>_<hidden>[_moe].pth (fp16, with its sidecar)
    and the resume file <stem>_resume.pth {model, optimizer, epoch, step, world_size, wandb_id, **kwargs (objects with a
    state_dict saved as it)}. Without a model: return that dict (step rescaled to this world size) or None.

    The file is MiniMind's own format, so `--from_resume 1` here and MiniMind's trainer both read it: the optimizer's
    parameter indices are saved in MiniMind's model.parameters() order and returned in ours (an optimizer over
    model.parameters(), as MiniMind builds it, loads the returned state as it is).
    """
    stem = weight_name(weight, lm_config)
    resume_path = minimind_resume_path(save_dir, stem)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if model is None:
        return _load_lm_checkpoint(lm_config, resume_path, world_size)
    os.makedirs(save_dir, exist_ok=True)
    raw_model = _unwrapped(model)
    state_dict = {k: v.half().cpu() for k, v in raw_model.state_dict().items()}
    save_weights_file(state_dict, lm_config, os.path.join(save_dir, stem + ".pth"))
    name_of = {id(p): name for name, p in raw_model.named_parameters()}
    ours = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    optimizer_state = minimind_resume.reindex_optimizer(optimizer.state_dict(), ours,
                                                        minimind_resume.minimind_parameter_order(lm_config))
    resume_data = dict(model=state_dict, optimizer=optimizer_state,
                       epoch=epoch, step=step, world_size=world_size, wandb_id=_tracker_id(wandb))
    for key, value in kwargs.items():
        if value is not None:
            resume_data[key] = _unwrapped(value).state_dict() if hasattr(value, "state_dict") else value
    atomic_save(resume_data, resume_path)


def _load_lm_checkpoint(lm_config, resume_path, world_size):
    """lm_checkpoint's load: the resume dict with the optimizer in our parameter order, or None when there is none."""
    if not os.path.exists(resume_path):
        return None
    data = torch.load(resume_path, map_location="cpu", weights_only=True)
    data["optimizer"] = minimind_resume.reindex_optimizer(
        data["optimizer"], minimind_resume.minimind_parameter_order(lm_config),
        minimind_resume.our_parameter_order(lm_config))
    saved_world = data.get("world_size", 1)
    if saved_world != world_size:  # MiniMind's rule: the same samples consumed, counted in this world's batches
        data["step"] = data["step"] * saved_world // world_size
        Logger(f"world size changed ({saved_world} -> {world_size}): step converted to {data['step']}")
    return data
