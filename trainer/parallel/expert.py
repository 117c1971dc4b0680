"""Expert parallelism: each MoE layer's routed experts sharded over the `ep` ranks, tokens sent to their experts'
ranks and back with all-to-all (torch.distributed all_to_all_single: gloo on CPU, NCCL on CUDA).

`apply_expert_parallel(model, ep_group)` keeps this rank's contiguous share of every layer's experts (ep rank r holds
experts r*E/ep .. (r+1)*E/ep - 1, under their global names, so the state dict keys are the full model's) and swaps
MOEFeedForward.experts_fn for `dispatch_to_experts`. The router, the aux loss and the shared experts stay local: every
rank routes its own tokens. Per layer and micro-batch: one all-to-all of the (experts,) counts, one host read of the
split sizes (all_to_all_single needs them on the host), then the rows out and the outputs back; autograd runs the
reverse all-to-alls in backward, so an expert's gradient sums the contributions of its ep group's tokens.

With ep < dp (ep carved out of dp: parallel/mesh.py) each expert is held by dp/ep ranks, one per ep group (its
expert-replica group, ep_replica); `reduce_expert_grads` sums their gradients once per step, as DDP does the rest.
Under context parallel the ep groups join ranks at the same cp coordinate (the same sequence part of other samples;
the MoE is token-wise, so each rank dispatches whatever tokens it holds) and ep_replica also holds the cp peers: each
expert is held by dp*cp/ep ranks, and the loss scale the experts undo is dp*cp (mesh.grad_reduce_factor).

With tensor parallel the routed experts stay whole (ETP=1, torchtitan's choice; parallel/tensor.py leaves them out of
its plan): they remain plain tensors, so the replica reduction, the clipped norm, FSDP2's ignored parameters and the
checkpoints work unchanged, and the grouped GEMMs still apply, where TP-sharded experts would need DTensor handling in
each of those and a tp all-reduce per expert. Every tp rank of a tp group routes the same replicated tokens (the
router is replicated) through its own ep group and gets the full loss gradient at the MoE output, so its experts'
gradients are the single process's and none is reduced over tp; the price is expert compute repeated tp times.
"""
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from model.moe import MOEFeedForward


def ep_validate(config, ep_size):
    """One line saying what to change if `config` cannot be split over `ep_size` ranks, else None."""
    if ep_size <= 1:
        return None
    if not config.use_moe:
        return f"--ep {ep_size} shards MoE experts: add --use_moe 1, or drop --ep"
    if config.num_experts % ep_size:
        return f"--ep {ep_size} must divide num_experts={config.num_experts}; choose an ep size that divides it"
    return None


def validate(args, config, zero_stage):
    """The dimension's check (parallel/mesh.py DIMENSIONS; that ep divides dp is the mesh's): one line, else None."""
    message = ep_validate(config, args.ep)
    if message:
        return message
    if zero_stage == 1:  # --tp, --pp and --cp compose: each stage's experts over its ep ranks, whole per tp rank
        return (f"--ep {args.ep} composes with DDP and FSDP2 (--zero_stage 0/2/3) only so far: "
                "drop --zero_stage 1 (its optimizer shards would mix ranks' experts)")
    if args.cpu_offload:  # the experts stay on the device, outside FSDP2's offloaded optimizer step
        return f"--ep {args.ep} keeps the experts on the device: drop --cpu_offload"
    if args.check_replicas:
        return "--check_replicas compares whole replicas; under --ep each rank holds other experts: leave it out"
    return None


def expert_params(model):
    """[(name, parameter)] of the routed experts (under expert parallel, this rank's own: no replica to reduce with)."""
    return [(name, param) for name, param in model.named_parameters() if ".experts." in name]


def apply_expert_parallel(model, ep_group, grad_divide=1):
    """Shard every MoE layer of `model` (a plain MiniMindForCausalLM, or a pipeline stage) over `ep_group` in place;
    return it. grad_divide: the experts' gradients are divided by it (the trainer scales the loss by dp*cp for data
    parallel's average, which the experts, reduced by their all-to-all and replica sum instead, do not go through)."""
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for module in model.modules():
        if not isinstance(module, MOEFeedForward):
            continue
        per_rank = module.config.num_experts // ep_size
        held = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        module.experts = nn.ModuleDict({str(i): module.experts[i] for i in held})  # global names: experts.<i>.*
        module.experts_fn = partial(dispatch_to_experts, module, ep_group)
    if grad_divide != 1:
        for _, param in expert_params(model):
            param.register_hook(partial(torch.div, other=grad_divide))
    return model


def reduce_expert_grads(model_parts, replica_group):
    """Sum the experts' gradients over `replica_group` (the ranks holding the same experts; none when ep = dp): each
    holds its ep group's tokens' share, already divided as the dense gradients are (apply_expert_parallel)."""
    if replica_group is None or dist.get_world_size(replica_group) == 1:
        return
    grads = [p.grad for part in model_parts for _, p in expert_params(part) if p.grad is not None]
    if grads:  # one flat buffer: one collective per step
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=replica_group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


def dispatch_to_experts(moe, group, rows, counts):
    """The outputs of `rows` (this rank's token slots sorted by global expert, counts[i] for expert i), computed on the
    ranks holding their experts; returned in the order of `rows`."""
    ep_size = dist.get_world_size(group)
    per_rank = counts.numel() // ep_size
    # received[s, j]: rows rank s sends to my local expert j
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send_sizes, recv_sizes = torch.stack([counts.view(ep_size, per_rank).sum(1),
                                          received.view(ep_size, per_rank).sum(1)]).tolist()  # one host read
    inbound = AllToAll.apply(rows, recv_sizes, send_sizes, group)
    # inbound is ordered by (source rank, local expert); the experts want it by local expert, sources in rank order
    local_expert = torch.arange(per_rank, device=rows.device).repeat(ep_size).repeat_interleave(received.long())
    order = local_expert.argsort(stable=True)
    out = moe.run_experts(inbound[order], received.view(ep_size, per_rank).sum(0))
    out = out[order.argsort()]  # back to (source rank, local expert)
    return AllToAll.apply(out, send_sizes, recv_sizes, group)


def all_to_all_rows(rows, recv_sizes, send_sizes, group):
    """all_to_all_single of (N, H) rows: send_sizes[r] rows to rank r, recv_sizes[r] from it, in rank order."""
    out = rows.new_empty(sum(recv_sizes), rows.shape[-1])
    dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_rows with its gradient: the same exchange backwards (torch's autograd all_to_all_single is
    deprecated; its replacement is private)."""

    @staticmethod
    def forward(ctx, rows, recv_sizes, send_sizes, group):
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        return all_to_all_rows(rows, recv_sizes, send_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        recv_sizes, send_sizes = ctx.sizes
        return all_to_all_rows(grad, send_sizes, recv_sizes, ctx.group), None, None, None
