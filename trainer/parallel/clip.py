"""Gradient-norm clipping over any layout: DTensor grads (FSDP2, TP) are reduced over their mesh and
pipeline stages' norms are summed over the pp group, so the norm equals the single-process one."""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.torch_compat import foreach_mul_
from trainer.base.launch import local_shard
from trainer.parallel.mesh import dimension_module


def _cpu_l2_norm(grads, error_if_nonfinite):
    """L2 norm as a float64-accumulated sum of squares (DTensor partial sums added, then reduced over the mesh).

    torch's CPU norm kernels accumulate in one fp32 register (pytorch#169237): 1.3e-4 relative error on a
    6400x64 embedding gradient, so the clipped norm overshot max_norm and each layout, summing other shards,
    clipped by a coefficient 3e-5 away from the single process's. CUDA's kernels reduce in a tree and are exact enough.
    Each row's squares are summed in fp32 (sum's cascade: a few ulps over a row) and the rows in float64, which is as
    exact as a float64 sum of every square and half its time (a float64 copy of each gradient was 2.7 of 2.9 ms a step
    for a 4-layer h256 model on one thread).
    """
    total = None
    for g in grads:
        square_sum = g.detach().square().sum(dim=-1).sum(dtype=torch.float64)
        total = square_sum if total is None else total + square_sum  # never a Python 0: a Partial adds it per rank
    total = total.full_tensor() if isinstance(total, DTensor) else total
    norm = total.sqrt()
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({float(norm)})")
    return norm


def _group_norm(grads, norm_type, error_if_nonfinite, foreach):
    """Norm of grads that share one type/mesh/placement; a DTensor norm is reduced over its mesh."""
    if norm_type == 2.0 and grads[0].device.type == "cpu":
        return _cpu_l2_norm(grads, error_if_nonfinite)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _total_norm(grads, norm_type, error_if_nonfinite, foreach, device):
    # DTensors on different meshes/placements (TP vs FSDP vs plain) cannot be stacked together.
    groups = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    norms = [_group_norm(gs, norm_type, error_if_nonfinite, foreach) for gs in groups.values()]
    if not norms:  # e.g. a pipeline stage whose parameters all got no gradient
        return torch.zeros((), device=device)
    norms = torch.stack([n.to(device, torch.float32) for n in norms])
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum().pow(1.0 / norm_type)


def _sum_norms(norms, norm_type):
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum().pow(1.0 / norm_type)


def _group_norm_sum(norm, norm_type, group):
    """The norm over the parts the ranks of `group` hold (each rank's `norm` of its own part)."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm.pow(norm_type)
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, pp_group=None, exclude=None,
                    error_if_nonfinite=False, foreach=None, sharded=None, sharded_group=None):
    """Clip gradients by their total norm over ALL ranks; return that norm (same as torch's on one process).

    DTensor grads (FSDP2, TP) are reduced over their mesh; pp_group sums the norms of the pipeline
    stages. exclude: parameters still clipped but left out of the norm, e.g. a pipeline stage's copy
    of the tied embedding, so each weight counts once. sharded: parameters each rank of `sharded_group` holds
    its own of (expert-parallel experts), their norms summed over that group.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    excluded = {id(p) for p in (exclude or ())}
    apart = {id(p) for p in (sharded or ())}
    counted = [p.grad for p in params if id(p) not in excluded | apart]
    device = params[0].grad.device if params else torch.device("cpu")
    total = _total_norm(counted, float(norm_type), error_if_nonfinite, foreach, device)
    if sharded_group is not None:
        shards = _total_norm([p.grad for p in params if id(p) in apart], float(norm_type), error_if_nonfinite,
                             foreach, device)
        total = _sum_norms(torch.stack([total, _group_norm_sum(shards, norm_type, sharded_group)]), norm_type)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total.pow(1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula
    by_device = {}
    for p in params:  # scale the local shards in place; no communication needed
        local = local_shard(p.grad)
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        foreach_mul_(tensors, clip_coef.to(device))
    return total


def clip_model_gradients(model_parts, max_norm, dims, pipeline=None):
    """Clip the gradients of this rank's `model_parts` over every rank's: a pipeline's tied embedding copies summed
    first and counted once, its stages' norms summed over pp, each expert-parallel rank's experts counted once (their
    replicas' gradients summed first when ep < dp)."""
    if pipeline is not None:
        pipeline.sync_tied_grads()
    params = [p for part in model_parts for p in part.parameters() if p.grad is not None]
    pp_group = dims.group("pp") if dims.size("pp") > 1 else None
    ep = dims.size("ep") > 1  # each ep rank's experts are its own: their norms add up over the ep ranks
    expert = dimension_module("ep") if ep else None
    experts = [p for part in model_parts for _, p in expert.expert_params(part)] if ep else None
    if ep:  # ep < dp: the expert replicas' gradients summed first (as DDP did the dense ones)
        expert.reduce_expert_grads(model_parts, dims.group("ep_replica"))
    return clip_grad_norm_(params, max_norm, pp_group=pp_group,
                           exclude=pipeline.duplicate_params() if pipeline is not None else None,
                           sharded=experts, sharded_group=dims.group("ep") if experts else None)
