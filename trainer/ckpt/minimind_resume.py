"""MiniMind's own resume file, `<checkpoint_dir>/<weight>_<hidden>[_moe]_resume.pth`, read as a resume checkpoint.

MiniMind's lm_checkpoint writes {model (fp16), optimizer (torch AdamW state, params by index), epoch, step,
world_size, wandb_id} plus extras such as scaler. The optimizer's indices follow MiniMind's model.parameters(), the
order its modules register their parameters (MINIMIND_MODULES), not ours; each moment is checked against the shape
of the parameter that order puts at its index. `step` counts the batches of --batch_size samples each process
took in `epoch`; MiniMind skips that many on resume. Its data order is not ours, so the same position (samples
consumed in the epoch) continues here, not the same samples.
"""

import torch

from model.errors import ConfigError
from model.model_minimind import MiniMindForCausalLM
from model.weights.files import numpy_rng_globals
from model.weights.flag_advice import mismatch_line
from model.weights.shapes import clean_state_dict
from trainer.base.log import Logger

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


# MiniMind's module definitions (jingyaogong/minimind, model/model_minimind.py): each module's children in the order its
# __init__ registers them, which model.parameters(), and so the indices of its AdamW state, follow. Entries are
# (attribute, module, config field giving an nn.ModuleList's length or None). Its FeedForward registers gate_proj,
# down_proj, up_proj (ours: gate, up, down); the names are the same, the order is not.
MINIMIND_MODULES = {
    "MiniMindForCausalLM": (("model", "MiniMindModel", None), ("lm_head", "Linear", None)),
    "MiniMindModel": (("embed_tokens", "Embedding", None), ("layers", "MiniMindBlock", "num_hidden_layers"),
                      ("norm", "RMSNorm", None)),
    "MiniMindBlock": (("self_attn", "Attention", None), ("input_layernorm", "RMSNorm", None),
                      ("post_attention_layernorm", "RMSNorm", None), ("mlp", "MLP", None)),
    "Attention": (("q_proj", "Linear", None), ("k_proj", "Linear", None), ("v_proj", "Linear", None),
                  ("o_proj", "Linear", None), ("q_norm", "RMSNorm", None), ("k_norm", "RMSNorm", None)),
    "FeedForward": (("gate_proj", "Linear", None), ("down_proj", "Linear", None), ("up_proj", "Linear", None)),
    "MOEFeedForward": (("gate", "Linear", None), ("experts", "FeedForward", "num_experts")),
}
LEAVES = ("Linear", "Embedding", "RMSNorm")  # one parameter each, `weight` (MiniMind's Linear layers have no bias)


def _registered(module, prefix, config):
    """Parameter names under `module` in MiniMind's registration order."""
    if module in LEAVES:
        yield prefix + "weight"
        return
    if module == "MLP":  # MiniMindBlock: FeedForward(config) if not config.use_moe else MOEFeedForward(config)
        module = "MOEFeedForward" if config.use_moe else "FeedForward"
    for attribute, child, repeat in MINIMIND_MODULES[module]:
        for index in range(getattr(config, repeat)) if repeat else [None]:
            yield from _registered(child, f"{prefix}{attribute}." + ("" if index is None else f"{index}."), config)


def minimind_parameter_order(config):
    """Our parameter names in the order of MiniMind's model.parameters(): a tied lm_head is the embedding's
    Parameter (MiniMind sets model.embed_tokens.weight = lm_head.weight), met first as model.embed_tokens.weight."""
    names = list(_registered("MiniMindForCausalLM", "", config))
    return [n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")]


def _optimizer_by_name(optimizer, config, path):
    """MiniMind's AdamW state (parameters by their index in its model.parameters()) keyed by parameter name, every
    moment checked against the shape of the parameter MiniMind's order puts at its index."""
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in MiniMindForCausalLM(config).named_parameters()}
    names = minimind_parameter_order(config)
    indices = [i for group in optimizer["param_groups"] for i in group["params"]]
    if sorted(indices) != list(range(len(names))) or set(names) != set(shapes):
        raise ConfigError(f"{path}: its optimizer holds {len(indices)} parameters, MiniMind's model of these flags "
                          f"{len(names)}; match the model flags or pass --from_resume 0")
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shapes[names[index]]:
                raise ConfigError(f"{path}: optimizer state {index} ({key}) has shape {list(value.shape)}, but "
                                  f"MiniMind's parameter {index} is {names[index]} of shape "
                                  f"{list(shapes[names[index]])}; this file was not written by MiniMind's "
                                  "model of these flags: pass --from_resume 0")
    return {"state": {names[i]: s for i, s in optimizer["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer["param_groups"]]}


def _fresh_scaler_state():
    """What an enabled GradScaler starts from: MiniMind's disabled scaler (bf16/fp32 runs) saved an empty dict."""
    return torch.amp.GradScaler("cpu", enabled=True).state_dict()


def read_minimind_resume(path, config, plan):
    """read_resume's dict from MiniMind's resume file: model, optimizer (by name), scaler, train_state, world_size.

    The position is kept in samples: MiniMind's step x its world_size x --batch_size (its file has no batch size:
    this run's is taken as its), over this run's global batch; a partial optimizer step is trained again.
    """
    ckpt = _load(path)
    model = clean_state_dict(ckpt["model"], config.tie_word_embeddings)
    with torch.device("meta"):
        message = mismatch_line(model, MiniMindForCausalLM(config), path)
    if message:
        raise ConfigError(message)
    saved_world = int(ckpt.get("world_size", 1))
    samples = int(ckpt["step"]) * saved_world * plan.data.micro_batch
    step_in_epoch = samples // plan.data.global_batch
    Logger(f"{path}: MiniMind's step {ckpt['step']} x {saved_world} processes x --batch_size {plan.data.micro_batch} = "
           f"{samples} samples of epoch {ckpt['epoch']}; at this run's global batch {plan.data.global_batch} that is "
           f"step {step_in_epoch} of the epoch (MiniMind's data order differs, so the position continues, not the "
           "samples)")
    scaler = ckpt.get("scaler") or (_fresh_scaler_state() if plan.model.dtype == torch.float16 else {})
    # global_step counts this epoch's steps only: the epochs before have the data's length, not known here
    train_state = dict(epoch=int(ckpt["epoch"]), step_in_epoch=step_in_epoch, global_step=step_in_epoch,
                       tokens_seen=0, tracker_id=ckpt.get("wandb_id"))
    return dict(model=model, optimizer=_optimizer_by_name(ckpt["optimizer"], config, path), scaler=scaler,
                train_state=train_state, world_size=saved_world, global_batch=plan.data.global_batch)


def our_parameter_order(config):
    """Our model.parameters() names in order (what an AdamW over them indexes by); a tied lm_head is met as the
    embedding, as in minimind_parameter_order."""
    with torch.device("meta"):
        return [name for name, _ in MiniMindForCausalLM(config).named_parameters()]


def reindex_optimizer(optimizer_state, old_names, new_names):
    """An optimizer state_dict whose parameter index i is old_names[i], re-indexed so that index j is new_names[j]."""
    missing = sorted(set(old_names) - set(new_names))
    if missing:
        raise ValueError(f"the optimizer holds {missing[0]}, which MiniMind's model has not; lm_checkpoint saves an "
                         "optimizer over the model's own parameters only")
    to_new = {i: new_names.index(name) for i, name in enumerate(old_names)}
    return {"state": {to_new[i]: s for i, s in optimizer_state["state"].items()},
            "param_groups": [dict(g, params=[to_new[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]}
