"""MiniMind's own resume file, `<checkpoint_dir>/<weight>_<hidden>[_moe]_resume.pth`, read as a resume checkpoint.

MiniMind's lm_checkpoint writes {model (fp16), optimizer (torch AdamW state, params by index), epoch, step,
world_size, wandb_id} plus extras such as scaler. `step` counts the batches of --batch_size samples each process
took in `epoch`; MiniMind skips that many on resume. Its data order is not ours, so the same position (samples
consumed in the epoch) continues here, not the same samples.
"""
import os

import torch

from model.model_minimind import MiniMindForCausalLM
from model.weights import clean_state_dict, numpy_rng_globals, shape_mismatch
from trainer.launch import ConfigError
from trainer.trainer_utils import Logger

LEGACY_HINT = ("format 1/2 single-file checkpoints were read up to commit 4df0373; resume it with that commit "
               "(its next save writes a step directory this trainer reads) or pass --from_resume 0")


def _load(path):
    try:
        with torch.serialization.safe_globals(numpy_rng_globals()):  # so a format 1/2 file (numpy RNG) is named
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{path} is not a readable resume file ({type(e).__name__}); delete it or pass "
                          "--from_resume 0") from None
    if isinstance(ckpt, dict) and ("format_version" in ckpt or "step_in_epoch" in ckpt):
        raise ConfigError(f"{path}: {LEGACY_HINT}")
    missing = [k for k in ("model", "optimizer", "epoch", "step") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"{path} is not MiniMind's resume file (no {', '.join(missing)}); delete it or pass "
                          "--from_resume 0")
    return ckpt


def _optimizer_by_name(optimizer, config, path):
    """MiniMind's AdamW state (parameters by their index in model.parameters()) keyed by parameter name."""
    with torch.device("meta"):
        names = [name for name, _ in MiniMindForCausalLM(config).named_parameters()]
    indices = [i for group in optimizer["param_groups"] for i in group["params"]]
    if sorted(indices) != list(range(len(names))):
        raise ConfigError(f"{path}: its optimizer holds {len(indices)} parameters, this model {len(names)}; "
                          "match the model flags or pass --from_resume 0")
    return {"state": {names[i]: s for i, s in optimizer["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer["param_groups"]]}


def _fresh_scaler_state():
    """What an enabled GradScaler starts from: MiniMind's disabled scaler (bf16/fp32 runs) saved an empty dict."""
    return torch.amp.GradScaler("cpu", enabled=True).state_dict()


def read_minimind_resume(path, config, plan):
    """load_resume's dict from MiniMind's resume file: model, optimizer (by name), scaler, train_state, world_size.

    The position is kept in samples: MiniMind's step x its world_size x --batch_size (its file has no batch size:
    this run's is taken as its), over this run's global batch; a partial optimizer step is trained again.
    """
    ckpt = _load(path)
    model = clean_state_dict(ckpt["model"], config.tie_word_embeddings)
    with torch.device("meta"):
        message = shape_mismatch(model, MiniMindForCausalLM(config), path)
    if message:
        raise ConfigError(message)
    saved_world = int(ckpt.get("world_size", 1))
    samples = int(ckpt["step"]) * saved_world * plan.micro_batch
    step_in_epoch = samples // plan.global_batch
    Logger(f"{path}: MiniMind's step {ckpt['step']} x {saved_world} processes x --batch_size {plan.micro_batch} = "
           f"{samples} samples of epoch {ckpt['epoch']}; at this run's global batch {plan.global_batch} that is step "
           f"{step_in_epoch} of the epoch (MiniMind's data order differs, so the position continues, not the samples)")
    scaler = ckpt.get("scaler") or (_fresh_scaler_state() if plan.dtype == torch.float16 else {})
    # global_step counts this epoch's steps only: the epochs before have the data's length, not known here
    train_state = dict(epoch=int(ckpt["epoch"]), step_in_epoch=step_in_epoch, global_step=step_in_epoch,
                       tokens_seen=0, tracker_id=ckpt.get("wandb_id"))
    return dict(model=model, optimizer=_optimizer_by_name(ckpt["optimizer"], config, path), scaler=scaler,
                train_state=train_state, world_size=saved_world, global_batch=plan.global_batch)


def minimind_resume_path(checkpoint_dir, stem):
    """Where MiniMind's lm_checkpoint keeps the resume file of weights `stem` (<weight>_<hidden>[_moe])."""
    return os.path.join(checkpoint_dir, stem + "_resume.pth")
