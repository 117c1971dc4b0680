"""Full (gathered, fp32, FQN-keyed) model/optimizer state of any layout, and loading it into any layout.

State dict format (what get_model_state_dict / get_optimizer_state_dict return with
full_state_dict=True on the single-process model):
  model:     {fqn: tensor}                          e.g. "model.layers.0.self_attn.q_proj.weight"
  optimizer: {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [fqn]}]}
A tied lm_head.weight appears in the model state (as in nn.Module.state_dict) but not in the
optimizer state, which holds the shared parameter once under model.embed_tokens.weight.

Sharded (DCP) format, sharded_state_dict / load_sharded_state: {"model": {fqn: tensor or DTensor shard},
"optim": {"state.<fqn>.<key>": ..., "param_groups.<fqn>.<key>": ...}} (flatten_optimizer_state_dict: keyed
per FQN, so pipeline stages holding disjoint FQNs save and reload under any split).

A ZeroRedundancyOptimizer (ZeRO-1) has no DTensor state: its paths (gathered and loaded whole, keyed by FQN) live
in the dp dimension's module, trainer/parallel/data.py, read through dimension_module("dp") by ZeRO-1 runs only.
"""
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from model.torch_compat import flatten_optim_state_dict
from trainer.base.launch import is_main_process
from trainer.parallel.mesh import dimension_module

# alias -> canonical FQN of a weight a pipeline stage keeps a synchronised copy of (tied embeddings).
TIED_EMBEDDING = {"lm_head.weight": "model.embed_tokens.weight"}
_WRAPPER_NAMES = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _unwrap(module):
    return module.module if isinstance(module, DistributedDataParallel) else module


def _merged_view(modules):
    """One module whose parameter names are the full-model FQNs of several pipeline parts.

    Parts share leaf modules (rotary_emb) and differ in containers (model.layers keyed by original
    index); shared objects are kept, containers present in several parts become fresh merged ones.
    """
    unique = list({id(m): m for m in map(_unwrap, modules)}.values())
    if len(unique) == 1:
        return unique[0]
    if any(m._parameters or m._buffers for m in unique):
        raise ValueError("pipeline parts disagree on a module that holds tensors itself")
    view = torch.nn.Module()
    names = list(dict.fromkeys(n for m in unique for n in m._modules))
    for name in names:
        view.add_module(name, _merged_view([m._modules[name] for m in unique if m._modules.get(name) is not None]))
    return view


def _optimizer_pairs(model_parts, optimizers):
    """(module, optimizer) pairs: one optimizer per part, or one optimizer over all parts."""
    parts, optims = _as_list(model_parts), _as_list(optimizers)
    if len(optims) == 1 and len(parts) > 1:
        return [(_merged_view(parts), optims[0])]
    if len(optims) != len(parts):
        raise ValueError(f"got {len(optims)} optimizers for {len(parts)} model parts; pass one per part or one for all")
    return list(zip(parts, optims))


def _group_size(group):
    """Ranks in `group` (a pp or ep group); 1 for none or one process."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _full_options(pp_group, ep_group=None):
    # cpu_offload keeps the gathered copy on global rank 0 only, which never holds a later stage or other experts.
    return StateDictOptions(full_state_dict=True,
                            cpu_offload=_group_size(pp_group) == 1 and _group_size(ep_group) == 1)


def _cpu_fp32(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu")
        return t.float() if t.is_floating_point() else t
    if isinstance(obj, dict):
        return {k: _cpu_fp32(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_fp32(v) for v in obj]
    return obj


def _gather_pp(obj, pp_group):
    """List of every pipeline stage's obj on global rank 0 (None elsewhere)."""
    if _group_size(pp_group) == 1:
        return [obj]
    if 0 not in dist.get_process_group_ranks(pp_group):
        return None  # only global rank 0's pp group carries the state anyone keeps
    root = dist.get_global_rank(pp_group, 0)
    out = [None] * dist.get_world_size(pp_group) if dist.get_rank() == root else None
    dist.gather_object(obj, out, dst=root, group=pp_group)
    return out


def _gather_experts(local, ep_group):
    """`local` with the experts of every rank of `ep_group` added on its rank 0 (expert parallel: each holds its own
    share of this stage's experts under their global names); only the experts travel."""
    if _group_size(ep_group) == 1:
        return local
    experts = {name: value for name, value in local.items() if ".experts." in name}
    root = dist.get_global_rank(ep_group, 0)
    shares = [None] * dist.get_world_size(ep_group) if dist.get_rank() == root else None
    dist.gather_object(experts, shares, dst=root, group=ep_group)
    for share in shares or ():
        local.update(share)
    return local


def clean_fqn(name):
    """Drop wrapper prefixes (DDP, torch.compile, activation checkpointing, FSDP1) from a parameter name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def full_model_state_dict(model_parts, pp_group=None, ep_group=None):
    """Full fp32 CPU model state keyed by FQN on global rank 0 (None on other ranks).

    model_parts: a module or the list of this rank's pipeline model parts (each keeps the full
    model's FQNs). ep_group: the expert-parallel ranks of this stage, whose experts are gathered first (global rank 0
    is ep rank 0 of its group, and so is every rank of its pp group). A collective: every rank must call it.
    """
    options = _full_options(pp_group, ep_group)
    local = {}
    for part in _as_list(model_parts):
        local.update(_cpu_fp32(get_model_state_dict(part, options=options)))
    stages = _gather_pp(_gather_experts(local, ep_group), pp_group)
    if not is_main_process():
        return None
    merged = {}
    for stage in stages:
        for k, v in stage.items():
            merged.setdefault(k, v)  # a tied copy on a later stage equals the first one
    return merged


def _with_aliases(optim_sd, tied_aliases):
    """Copy of optim_sd where each alias FQN also carries its canonical weight's state and group."""
    state = dict(optim_sd["state"])
    groups = [dict(g, params=list(g["params"])) for g in optim_sd["param_groups"]]
    for alias, canonical in (tied_aliases or {}).items():
        if canonical in state and alias not in state:
            state[alias] = state[canonical]
            next(g for g in groups if canonical in g["params"])["params"].append(alias)
    return {"state": state, "param_groups": groups}


def load_full_state(model_parts, optimizers, model_sd, optim_sd=None, tied_aliases=None):
    """Load a full FQN-keyed state (from full_*_state_dict) into any layout; each part takes its keys.

    Every rank passes the whole dicts (e.g. torch.load(map_location="cpu") on every rank);
    sharded/DTensor parameters take their own slice. model_sd=None skips the model (already loaded
    into the plain model before wrapping); optimizers/optim_sd=None skips the optimizer.
    Like Optimizer.load_state_dict, the optimizer may keep optim_sd's tensors: do not reuse the dict.
    """
    options = StateDictOptions(full_state_dict=True, strict=True)
    for part in _as_list(model_parts) if model_sd is not None else []:
        keys = get_model_state_dict(part, options=StateDictOptions(full_state_dict=False)).keys()
        missing = [k for k in keys if k not in model_sd]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} model keys, e.g. {missing[:3]}")
        set_model_state_dict(part, {k: model_sd[k] for k in keys}, options=options)
    if optimizers is None or optim_sd is None:
        return
    optim_sd = _with_aliases(optim_sd, tied_aliases)
    for part, optim in _optimizer_pairs(model_parts, optimizers):
        if isinstance(optim, ZeroRedundancyOptimizer):
            dimension_module("dp").load_zero(part, optim, optim_sd)
        else:
            set_optimizer_state_dict(part, optim, optim_state_dict=optim_sd, options=options)


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _optim_pair(model_parts, optimizer):
    (pair,) = _optimizer_pairs(model_parts, [optimizer])
    return pair


def sharded_state_dict(model_parts, optimizer, tied_aliases=None):
    """This rank's model and optimizer state for dcp.save: DTensor shards stay shards (a collective under ZeRO-1).

    tied_aliases: the optimizer state of an alias (a pipeline stage's copy of the tied embedding) is left out;
    the canonical weight's state, identical, is saved by the stage that owns it.
    """
    model = {}
    for part in _as_list(model_parts):
        model.update(get_model_state_dict(part))
    part, optim = _optim_pair(model_parts, optimizer)
    if isinstance(optim, ZeroRedundancyOptimizer):  # no DTensor state to shard: rank 0 of the group saves it whole
        osd = dimension_module("dp").zero_state_dict(part, optim)
        optim_sd = flatten_optim_state_dict(osd) if osd else {}
    else:
        optim_sd = get_optimizer_state_dict(part, optim, options=_FLAT)
    aliases = tuple(f"{section}.{alias}." for alias in tied_aliases or {} for section in ("state", "param_groups"))
    return {"model": model, "optim": {k: v for k, v in optim_sd.items() if not k.startswith(aliases)}}


def _read_tied(section, saved_keys, tied_aliases):
    """{key to read: key of `section`}: an alias the checkpoint lacks reads its canonical weight's entry."""
    reads = {}
    for key in section:
        read = key
        if key not in saved_keys:
            for alias, canonical in (tied_aliases or {}).items():
                read = read.replace(alias, canonical, 1)
        reads[read if read not in section else key] = key
    return reads


def load_sharded_state(model_parts, optimizer, checkpoint_dir, tied_aliases=None):
    """Load a sharded_state_dict save into any layout: DCP reads each rank's slice of every tensor (a collective)."""
    saved = set(dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)
    model = {}
    for part in _as_list(model_parts):
        model.update(get_model_state_dict(part))
    part, optim = _optim_pair(model_parts, optimizer)
    zero = dimension_module("dp") if isinstance(optim, ZeroRedundancyOptimizer) else None
    optim_sd = zero.zero_template(part, optim) if zero else get_optimizer_state_dict(part, optim, options=_FLAT)
    reads = {name: _read_tied(section, {k[len(name) + 1:] for k in saved if k.startswith(name + ".")}, tied_aliases)
             for name, section in (("model", model), ("optim", optim_sd))}
    state = {"model": {r: model[k] for r, k in reads["model"].items()},
             "optim": {r: optim_sd[k] for r, k in reads["optim"].items()}}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model = {k: state["model"][r] for r, k in reads["model"].items()}
    optim_sd = {k: state["optim"][r] for r, k in reads["optim"].items()}
    for part_module in _as_list(model_parts):
        keys = get_model_state_dict(part_module).keys()
        set_model_state_dict(part_module, {k: model[k] for k in keys})
    if zero:
        zero.load_zero(part, optim, zero.unflatten_zero(part, optim, optim_sd))
    else:
        set_optimizer_state_dict(part, optim, optim_state_dict=optim_sd, options=_FLAT)
