"""Tensor parallelism (Megatron-style, with optional sequence parallelism) for MiniMindForCausalLM.

Applied from outside to the plain model with DTensor's `parallelize_module`, in the style of
torchtitan's `parallelize_llama`. Per block:
  self_attn.{q,k,v}_proj  ColwiseParallel   (sharded by heads: Attention infers local head counts)
  self_attn.{q,k}_norm    SequenceParallel(sequence_dim=heads axis)  (per-head RMSNorm on local heads)
  self_attn.o_proj        RowwiseParallel   (all-reduce, or reduce-scatter to the sequence with SP)
  mlp.{gate,up}_proj      ColwiseParallel,  mlp.down_proj RowwiseParallel
  MoE: every expert (and shared expert) sharded like the dense MLP; router `mlp.gate` replicated.
  Under expert parallel (shard_experts=False) the routed experts stay plain, whole modules (ETP=1, as torchtitan):
  parallel/expert.py shards them over the ep ranks, each tp rank of a tp group running the same tokens through them.
Embedding is vocab-parallel (RowwiseParallel) and lm_head column-parallel with vocab-sharded
logits, so cross-entropy runs under `loss_parallel()` without gathering the full logits.
With sequence_parallel the norms run on sequence shards (SequenceParallel), attention/MLP inputs are
all-gathered and o_proj/down_proj reduce-scatter back to the sequence-sharded residual stream.
After this call every parameter is a DTensor on `tp_mesh` (norms and router are Replicate) and
every grad has its parameter's placement, so plain AdamW and `clip_grad_norm_` work unchanged.
"""
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from model.lora import lora_tp_plan

# In q = q_proj(x).view(B, L, heads, head_dim) the heads axis is 2; q/k_norm see that layout.
HEADS_DIM = 2


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; the module still takes and returns plain tensors.

    Used for modules that compute the same thing on every tp rank (norms without SP, the MoE
    router), so that all parameters share one type and optimizers / grad clipping need no special case.
    """

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, None, self._inputs_in, self._output_out)

    @staticmethod
    def _inputs_in(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

    @staticmethod
    def _output_out(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output


class PrepareHiddenInput(ParallelStyle):
    """Redistribute a module's hidden-states input (first positional or `hidden_states=`) to a local tensor.

    Other arguments (RoPE cos/sin, mask, cache) pass through untouched, whatever their number,
    which PrepareModuleInput cannot express without pinning the call's arity.
    """

    def __init__(self, input_layout, desired_layout):
        self.input_layout, self.desired_layout = input_layout, desired_layout

    def _apply(self, module, device_mesh):
        module.register_forward_pre_hook(partial(self._prepare, device_mesh), with_kwargs=True)
        return module

    def _prepare(self, mesh, module, args, kwargs):
        def convert(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
            return x.redistribute(mesh, (self.desired_layout,)).to_local()
        if args:
            return (convert(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}


def tp_validate(config, tp_size, seq_len=None):
    """One-line error message if `config` cannot be split over `tp_size` ranks, else None.

    Pass `seq_len` (the training sequence length) when sequence parallel is on: it is split over tp.
    """
    if tp_size <= 1:
        return None
    if seq_len is not None and seq_len % tp_size:
        return f"sequence parallel needs max_seq_len ({seq_len}) divisible by --tp {tp_size}"
    dims = {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "vocab_size": config.vocab_size}
    if config.use_moe:  # experts (and shared experts) are sharded like the dense MLP
        dims["moe_intermediate_size"] = config.moe_intermediate_size
    else:
        dims["intermediate_size"] = config.intermediate_size
    for name, value in dims.items():
        if value % tp_size:
            return f"--tp {tp_size} must divide {name}={value}; choose a tp size that divides it"
    return None


def validate(args, config, zero_stage):
    """The dimension's check (parallel/mesh.py DIMENSIONS): one line saying what to change, else None."""
    return tp_validate(config, args.tp, seq_len=args.max_seq_len // args.cp if args.sequence_parallel else None)


def tp_loss_context(enabled):
    """Context for forward+backward: `loss_parallel()` when logits are vocab-sharded, else a no-op."""
    return loss_parallel() if enabled else nullcontext()


def _mlp_plan(prefix, sequence_parallel):
    """Column-wise gate/up, row-wise down for one FeedForward (dense MLP or one expert)."""
    return {f"{prefix}.gate_proj": ColwiseParallel(),
            f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())}


def _block_plan(prefix, block, sequence_parallel, shard_experts=True):
    """Plan for one MiniMindBlock, keyed by FQN relative to the root model (routed experts left out unless
    shard_experts)."""
    seq = Shard(1)
    plan = {}
    if sequence_parallel:
        # the block takes the sequence-sharded residual stream as a local tensor (B, L/tp, H)
        plan[prefix] = PrepareHiddenInput(seq, seq)
        plan[f"{prefix}.input_layernorm"] = SequenceParallel()
        plan[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
        # all-gather the sequence before attention; other arguments (RoPE cos/sin, mask) pass through
        plan[f"{prefix}.self_attn"] = PrepareHiddenInput(seq, Replicate())
    else:
        plan[f"{prefix}.input_layernorm"] = ReplicateParallel()
        plan[f"{prefix}.post_attention_layernorm"] = ReplicateParallel()
    attn = f"{prefix}.self_attn"
    plan.update({f"{attn}.q_proj": ColwiseParallel(), f"{attn}.k_proj": ColwiseParallel(),
                 f"{attn}.v_proj": ColwiseParallel(),
                 # per-head norm on the local heads; its Partial weight grad is summed by _reduce_partial_grad
                 f"{attn}.q_norm": SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True),
                 f"{attn}.k_norm": SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True),
                 f"{attn}.o_proj": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())})

    mlp = block.mlp
    if hasattr(mlp, "experts"):
        # MoE: the router sees all tokens on every rank (aux loss is sequence-level), each expert is
        # sharded like a dense MLP and returns replicated output, so routing is unchanged
        if sequence_parallel:
            plan[f"{prefix}.mlp"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        plan[f"{prefix}.mlp.gate"] = ReplicateParallel()
        if shard_experts:
            mlp.expert_compute = "loop"  # the sharded Linears run their TP hooks; a grouped GEMM bypasses them
            for e in range(len(mlp.experts)):
                plan.update(_mlp_plan(f"{prefix}.mlp.experts.{e}", False))
        for s in range(len(getattr(mlp, "shared_experts", None) or [])):
            plan.update(_mlp_plan(f"{prefix}.mlp.shared_experts.{s}", False))
    else:
        if sequence_parallel:
            plan[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                       use_local_output=True)
        plan.update(_mlp_plan(f"{prefix}.mlp", sequence_parallel))
    return plan


def _reduce_partial_grad(param):
    """Sum a Partial grad over the tp group, so every grad has its parameter's placement."""
    # a replicated weight applied to sharded activations (q/k_norm, SP norms) gets a Partial(sum) grad
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def _loss_to_local(module, inputs, output):
    """Hand the trainer a plain loss tensor (the loss_parallel loss is a Replicate DTensor)."""
    if isinstance(getattr(output, "loss", None), DTensor):
        output.loss = output.loss.to_local()
    return output


def apply_tensor_parallel(model, tp_mesh, sequence_parallel=False, loss_parallel=True, shard_experts=True):
    """Shard `model` (a plain MiniMindForCausalLM) over the 1-D `tp_mesh` in place; return it.

    shard_experts=False (expert parallel) leaves the routed experts plain and whole on every tp rank (ETP=1): their
    input is the replicated MoE input, their gradients the full, equal ones of every tp rank, so none is reduced.
    With loss_parallel=True `output.logits` is a vocab-sharded DTensor and forward+backward must run
    inside `tp_loss_context(True)`; with False the logits are gathered (Replicate, plain tensor).
    `output.loss` is always a plain tensor.
    """
    inner = model.model
    embed, lm_head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = embed is not None and lm_head is not None and lm_head.weight is embed.weight
    seq = Shard(1)
    plan = {}  # a pipeline stage holds only some of these parts; plan the ones present
    if embed is not None:
        # vocab-parallel embedding: masked lookup, then all-reduce (or reduce-scatter to the sequence)
        # with SP it stays a DTensor so MiniMindModel derives positions from the full sequence length
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=seq if sequence_parallel else Replicate(),
                                                     use_local_output=not sequence_parallel)
    if getattr(inner, "norm", None) is not None:
        plan["model.norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    layers = inner.layers.items() if isinstance(inner.layers, nn.ModuleDict) else enumerate(inner.layers)
    for i, block in layers:
        plan.update(_block_plan(f"model.layers.{i}", block, sequence_parallel, shard_experts))
    plan.update(lora_tp_plan(model, plan))  # LoRA adapters (if any) sharded to match their base layers
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize_module(model, tp_mesh, plan)

    if tied:
        # each style made its own Parameter; re-tie so both uses accumulate into one Shard(0) grad
        model.lm_head.weight = model.model.embed_tokens.weight
    missed = [name for name, p in model.named_parameters()
              if not isinstance(p, DTensor) and (shard_experts or ".experts." not in name)]
    if missed:  # a model change the plan does not know about; fail loudly rather than train wrong
        raise RuntimeError(f"tensor-parallel plan does not cover parameters: {missed}")
    for name, param in model.named_parameters():
        param.requires_grad_(trainable[name])  # the styles make new Parameters, trainable; a frozen base stays frozen
        if param.requires_grad and getattr(param, "placements", None) == (Replicate(),):  # plain: routed experts
            param.register_post_accumulate_grad_hook(_reduce_partial_grad)
    model.register_forward_hook(_loss_to_local)
    return model
