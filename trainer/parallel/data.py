"""Data parallelism: DDP (ZeRO 0), DDP + ZeroRedundancyOptimizer (ZeRO 1), FSDP2 (ZeRO 2 and 3).

Gradient semantics: DDP and FSDP2 AVERAGE gradients over the data-parallel group (dp, or dp x cp
when context parallel is on). The training step wants the gradient of the loss of the whole global
batch, i.e. the SUM of the per-rank gradients of `ce_sum / num_items` (num_items counted over all
ranks). So the trainer multiplies each rank's loss by `mesh.grad_reduce_factor(layout)` = dp * cp; the
average of the scaled gradients is then exactly the single-process gradient.

The dp dimension's module (mesh.py DIMENSIONS): read by a run with a data-parallel group or a ZeRO / compression
flag only (plan/checks.py data_parallel_mode, parallelize.py, core/loop.py, runtime/optimizer_choice.py, and
state_dict.py for a ZeRO-1 optimizer's state).
"""
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from trainer.base.errors import TrainingHalted
from trainer.base.launch import local_shard
from trainer.parallel.perf import decoder_blocks
from trainer.parallel.state_dict import clean_fqn

ZERO_STAGES = (0, 1, 2, 3)
GRAD_COMPRESSIONS = ("none", "bf16", "powersgd")


def validate_data_parallel(zero_stage, grad_compression="none", dp=1, tp=1, pp=1):
    """Return one line saying what to change for a bad combination, else None (call before any collective).

    dp: size of the gradient-reduction group (dp * cp); pp composes with every stage (one wrap per stage).
    """
    if zero_stage not in ZERO_STAGES:
        return f"--zero_stage must be one of 0, 1, 2, 3 (got {zero_stage})"
    if grad_compression not in GRAD_COMPRESSIONS:
        return f"--grad_compression must be one of {', '.join(GRAD_COMPRESSIONS)} (got {grad_compression})"
    if grad_compression != "none" and zero_stage >= 2:
        return (f"--grad_compression {grad_compression} uses DDP communication hooks, which FSDP "
                f"(--zero_stage {zero_stage}) does not have; use --zero_stage 0 or 1, or --grad_compression none")
    if tp > 1 and zero_stage <= 1 and dp > 1:
        # DDP cannot broadcast/all-reduce DTensor parameters (torchtitan rejects DDP + TP as well).
        return (f"--zero_stage {zero_stage} (DDP) cannot be combined with --tp {tp}; "
                f"use --zero_stage 2 or 3 (FSDP2 composes with tensor parallel)")
    return None


def _bf16_compress_hook(state, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses that name on CPU-only builds even
    though gloo all-reduces bfloat16 fine; the hook itself is unchanged."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _register_compression(ddp_model, group, grad_compression, powersgd_rank, powersgd_start_iter):
    if grad_compression == "bf16":
        nccl = dist.get_backend(group) == "nccl"
        ddp_model.register_comm_hook(group, default_hooks.bf16_compress_hook if nccl else _bf16_compress_hook)
    elif grad_compression == "powersgd":
        # Until start_powerSGD_iter the hook does a plain (exact) all-reduce: the warm-up phase.
        from trainer.parallel import powersgd  # read by --grad_compression powersgd runs only
        hook = powersgd.ResumablePowerSGD(group, powersgd_rank, powersgd_start_iter,
                                          {id(p): name for name, p in ddp_model.module.named_parameters()})
        ddp_model.register_comm_hook(hook.state, hook.hook)
        ddp_model.comm_hook = hook  # its state goes into resume checkpoints (trainer/ckpt/parts.py powersgd_part)


def apply_data_parallel(model, dp_mesh, zero_stage=0, grad_compression="none", *, powersgd_rank=1,
                        powersgd_start_iter=1000, param_dtype=None, find_unused_parameters=False, cpu_offload=False,
                        ignored=()):
    """Wrap `model` (or one pipeline model part) for data parallelism over the 1-D `dp_mesh`.

    dp_mesh: the dp mesh, or the flattened dp_cp mesh when context parallel is on (a ParallelDims
    stands for its dp_cp_mesh).
    zero_stage 0/1: DistributedDataParallel over dp_mesh's group (stage 1 also needs
    data_parallel_optimizer(..., zero_stage=1)); grad_compression none | bf16 | powersgd via DDP comm hooks.
    zero_stage 2/3: FSDP2 fully_shard on each decoder block then the root; parameters stay sharded
    between steps, and stage 3 also frees the gathered parameters after each forward.
    param_dtype: FSDP2 gathers parameters in this dtype (the autocast dtype; None keeps fp32); gradients are
    always reduced in fp32. powersgd_*: the hook's rank and warm-up steps (--powersgd_rank, --powersgd_start_step).
    cpu_offload: FSDP2 keeps the sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy).
    ignored: names of parameters DDP / FSDP2 leave alone (expert-parallel experts: each rank holds its own).
    Returns the wrapped module (DDP) or the same module, now an FSDPModule. A size-1 mesh returns
    `model` unchanged.
    """
    message = validate_data_parallel(zero_stage, grad_compression)
    if message:
        raise ValueError(message)
    dp_mesh = getattr(dp_mesh, "dp_cp_mesh", dp_mesh)  # accept a ParallelDims
    if dp_mesh is None or dp_mesh.size() == 1:
        return model
    if zero_stage <= 1:
        group = dp_mesh.get_group()
        device = next(model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
        ddp_model = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                            find_unused_parameters=find_unused_parameters)
        _register_compression(ddp_model, group, grad_compression, powersgd_rank, powersgd_start_iter)
        return ddp_model

    reshard = zero_stage == 3  # ZeRO-2: keep gathered params from forward to backward
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    extra = dict(offload_policy=CPUOffloadPolicy()) if cpu_offload else {}  # needs CUDA (checked by resolve)
    if ignored:  # plain local tensors, reduced by their owner (parallel/expert.py's reduce_expert_grads)
        names = set(ignored)
        extra["ignored_params"] = {p for n, p in model.named_parameters() if n in names}
    for block in decoder_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy, **extra)
    # The root group takes everything left: embed_tokens, norm and lm_head. A tied lm_head.weight is
    # the same Parameter as embed_tokens.weight; FSDP2 manages it once and re-ties both attributes.
    # The root stays gathered from forward to backward (backward needs it at once): FSDP2's own default
    # for the root, which an explicit True would override with one more all-gather per micro-batch.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, **extra)
    model.keep_gathered_across_microbatches = zero_stage == 2  # read by gradient_sync
    return model


@contextmanager
def gradient_sync(model_parts, enabled):
    """Context for one micro-batch's backward: with `enabled` False, gradients accumulate locally and are
    reduced later (DDP's no_sync; FSDP2's set_requires_gradient_sync). Enable it on the last micro-batch.

    Under FSDP2 the skipped micro-batches keep unsharded gradients until then: memory for 1/accumulation
    of the reduce-scatter traffic. ZeRO-2 also keeps the gathered parameters until the last micro-batch's
    backward (set_reshard_after_backward): one all-gather per step instead of one per micro-batch.
    """
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    fsdp = [] if enabled else [p for p in parts if isinstance(p, FSDPModule)]
    gathered = [p for p in fsdp if getattr(p, "keep_gathered_across_microbatches", False)]
    with ExitStack() as stack:
        for part in parts:
            if not enabled and isinstance(part, DistributedDataParallel):
                stack.enter_context(part.no_sync())
        for part in fsdp:
            part.set_requires_gradient_sync(False)
        for part in gathered:
            part.set_reshard_after_backward(False)
        try:
            yield
        finally:
            for part in fsdp:
                part.set_requires_gradient_sync(True)
            for part in gathered:  # the next forward finds them unsharded; the last backward reshards
                part.set_reshard_after_backward(True)


def data_parallel_optimizer(params, lr, zero_stage=0, dp_group=None, fused=None, optimizer_class=torch.optim.AdamW,
                            **optimizer_kwargs):
    """`optimizer_class` (AdamW by default), or for zero_stage 1 ZeroRedundancyOptimizer(optimizer_class) sharding
    its state over dp_group.

    params: an iterable of parameters or of param-group dicts. dp_group: the gradient-reduction
    group (dp_cp). Stage 1 still needs DDP from
    apply_data_parallel for the gradient all-reduce. fused=None keeps the default kernel (AdamW's fused flag).
    """
    params = list(params)
    if fused is not None:
        optimizer_kwargs["fused"] = fused
    if zero_stage == 1 and dp_group is not None and dist.get_world_size(dp_group) > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=dp_group,
                                       lr=lr, **optimizer_kwargs)
    return optimizer_class(params, lr=lr, **optimizer_kwargs)


def replica_checksums(model_parts):
    """(names, tensor [n, 2]): float64 sum and sum of squares of each parameter's local values."""
    names, sums = [], []
    for part in model_parts:
        for name, param in part.named_parameters():
            local = local_shard(param.detach()).double()
            names.append(clean_fqn(name))
            sums.append(torch.stack([local.sum(), (local * local).sum()]))
    return names, torch.stack(sums)


def check_replicas(model_parts, group, step):
    """Raise TrainingHalted naming the first parameter whose checksum differs across the replicas of `group`."""
    names, mine = replica_checksums(model_parts)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for i, name in enumerate(names):
        ranks = [r for r, other in enumerate(gathered) if not torch.equal(other[i], gathered[0][i])]
        if ranks:
            raise TrainingHalted(f"--check_replicas: at step {step} parameter {name} differs between data-parallel "
                                 f"replicas (group ranks {ranks} vs 0); the replicas diverged, resume from the last "
                                 "checkpoint and look for non-deterministic or rank-dependent code")


# ----------------------------------------------------------------------------- ZeRO-1 state dicts
# trainer/parallel/state_dict.py reaches these through dimension_module("dp") when the optimizer is a
# ZeroRedundancyOptimizer: its state has no DTensor shards, so it is gathered and loaded whole, keyed by FQN.
def param_fqns(part):
    """{id(parameter): its clean FQN} of a model part: how a ZeroRedundancyOptimizer's index-keyed state is named."""
    return {id(p): clean_fqn(n) for n, p in part.named_parameters()}


def zero_state_dict(part, optim):
    """FQN-keyed full state of a ZeroRedundancyOptimizer via consolidate_state_dict (collective)."""
    optim.consolidate_state_dict(to=0)
    if dist.get_rank(optim.process_group) != 0:
        return {}
    names = param_fqns(part)
    index_to_fqn = [names[id(p)] for g in optim.param_groups for p in g["params"]]
    sd = optim.state_dict()
    return {"state": {index_to_fqn[i]: s for i, s in sd["state"].items()},
            "param_groups": [dict(g, params=[index_to_fqn[i] for i in g["params"]]) for g in sd["param_groups"]]}


def load_zero(part, optim, optim_sd):
    """Load an FQN-keyed full state into a ZeroRedundancyOptimizer (each rank keeps its shard)."""
    names = param_fqns(part)
    fqns = [names[id(p)] for g in optim.param_groups for p in g["params"]]
    state, groups, index = {}, [], 0
    for group in optim.param_groups:
        first = names[id(group["params"][0])]
        saved = next(g for g in optim_sd["param_groups"] if first in g["params"])
        groups.append(dict(saved, params=list(range(index, index + len(group["params"])))))
        index += len(group["params"])
    for i, fqn in enumerate(fqns):
        if fqn in optim_sd["state"]:
            state[i] = {k: v.clone() if torch.is_tensor(v) else v for k, v in optim_sd["state"][fqn].items()}
    optim.load_state_dict({"state": state, "param_groups": groups})
    place_step_for_kernel(optim.optim)


def place_step_for_kernel(optim):
    """Put AdamW's `step` where its kernel reads it: on the parameter's device, fp32, when fused or capturable.

    ZeroRedundancyOptimizer.load_state_dict moves every 0-dim state tensor to the CPU, and the fused CUDA kernel
    then fails on mixed devices (pytorch#124133). Does nothing for the default kernels or CPU parameters.
    """
    for group in optim.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            step = optim.state.get(p, {}).get("step")
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                optim.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


def state_template(group, param):
    """{state key: zeros} `param` holds under the optimizer of its param group `group`, known by the group's
    hyper-parameters: momentum without betas (SGD, LARS) or a Muon group: momentum_buffer; else Adam's moments
    (AdamW, LAMB, Muon's AdamW groups)."""
    if group.get("muon") or ("momentum" in group and "betas" not in group):
        return {"momentum_buffer": torch.zeros_like(param)} if group.get("momentum") else {}
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}


def zero_template(part, optim):
    """The flattened state a ZeroRedundancyOptimizer's parameters take (full shapes: it loads the whole)."""
    names = param_fqns(part)
    template = {}
    for group in optim.param_groups:
        for p in group["params"]:
            fqn = names[id(p)]
            template.update({f"state.{fqn}.{k}": v for k, v in state_template(group, p).items()})
            template.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return template


def unflatten_zero(part, optim, flat):
    """The FQN-keyed {"state", "param_groups"} dict load_zero takes, from the flattened template."""
    names = param_fqns(part)
    state, groups = {}, []
    for group in optim.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        for fqn, p in zip(fqns, group["params"]):
            state[fqn] = {k: flat[f"state.{fqn}.{k}"] for k in state_template(group, p)}
        groups.append(dict({k: flat[f"param_groups.{fqns[0]}.{k}"] for k in group if k != "params"}, params=fqns))
    return {"state": state, "param_groups": groups}
