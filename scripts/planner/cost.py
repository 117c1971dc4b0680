"""The layout model: memory per rank and communication per optimizer step of a parallel layout (formulas:
docs/scaling.md); scripts/bench.py --plan, scripts/planner/fit.py and scripts/planner/scaling.py read it.

Every dimension enters by name from trainer/parallel/mesh.py's DIMENSIONS: what of a rank's share it divides
(Dimension.divides: the layers, each weight matrix, each sequence's tokens, the routed experts), whether ZeRO shards the
states over it (reduces_gradients: the gradient-reduction group) and its bytes on the wire, one function per dimension
in COMMUNICATION whose entries are named `<dimension>_...` (tests/test_layout_model.py names a dimension without one).
Checked against hand counts and the real model in tests/test_layout_model.py and tests/test_bench.py.
"""
import math
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.parallel.mesh import BY_NAME, DIMENSIONS, grad_reduce_factor

GB = 2 ** 30  # the figures named _gb are GiB
# what a dimension can cut of one rank's share (mesh.py's Dimension.divides); ZeRO's shards of the weights, gradients
# and optimizer state follow Dimension.reduces_gradients instead (the gradient-reduction group)
PARTS = {"layers": "the decoder layers (one pipeline stage's share)",
         "matrices": "each weight matrix, the vocabulary one included, and so their outputs (heads, MLP columns)",
         "tokens": "each sequence's tokens (activations, logits)",
         "experts": "each MoE layer's routed experts"}


def layout_sizes(layout=None):
    """{dimension name: size} in DIMENSIONS order, from a mapping by name (missing dimensions are 1, an unknown name
    raises KeyError) or from an object with one attribute per dimension (the plan's Layout)."""
    if layout is None or isinstance(layout, Mapping):
        layout = layout or {}
        unknown = sorted(set(layout) - set(BY_NAME))
        if unknown:
            raise KeyError(f"no parallel dimension {unknown}; known: {', '.join(BY_NAME)}")
        return {d.name: layout.get(d.name, 1) for d in DIMENSIONS}
    return {d.name: getattr(layout, d.name) for d in DIMENSIONS}


def divisor(sizes, part):
    """Into how many pieces one rank's `part` (PARTS) is cut: the product of the sizes of the dimensions that
    divide it (1 when none does)."""
    if part not in PARTS:
        raise KeyError(f"no part {part!r}; the parts: {', '.join(PARTS)}")
    return math.prod(sizes[d.name] for d in DIMENSIONS if part in d.divides)


def layer_params(config):
    """Parameters of one decoder layer: attention, the MLP (or the MoE experts and router), the norms."""
    h, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    if config.use_moe:  # routed + shared experts of moe_intermediate_size, and the router
        experts = config.num_experts + config.n_shared_experts
        mlp = 3 * h * config.moe_intermediate_size * experts + h * config.num_experts
    else:
        mlp = 3 * h * config.intermediate_size
    return 2 * h * q_dim + 2 * h * kv_dim + mlp + 2 * h + 2 * head_dim


def routed_expert_params(config):
    """Parameters of one layer's routed experts (what expert parallel shards over the ep ranks); 0 for a dense MLP."""
    return 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts if config.use_moe else 0


def activation_elements(config, sizes, sequence_parallel):
    """Saved activation elements per token per layer on one rank (measured on MiniMindBlock, within 1%).

    12h + 2 kv + 4 I, the matrices' outputs split with them (tp); the 4h of norm inputs/outputs stay whole unless
    sequence parallel; when the routed experts are split apart (ep) their 4 I per slot are whole on every rank (ETP=1:
    not tensor-parallel).
    """
    h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    split, experts_apart = divisor(sizes, "matrices"), divisor(sizes, "experts") > 1
    if not config.use_moe:
        split_width, whole_width = config.intermediate_size, 0
    else:
        routed = config.moe_intermediate_size * config.num_experts_per_tok
        split_width = config.moe_intermediate_size * config.n_shared_experts + (0 if experts_apart else routed)
        whole_width = routed if experts_apart else 0
    return 4 * h / (split if sequence_parallel else 1) + (8 * h + 2 * kv_dim + 4 * split_width) / split \
        + 4 * whole_width


@dataclass(frozen=True)
class Step:
    """One rank's share of one optimizer step: what a dimension's communication term reads."""
    config: object
    sizes: dict  # {dimension name: size}
    tokens: float  # of one micro-batch on one rank
    layers: int  # decoder layers on one rank
    microbatches: int
    zero_stage: int
    act_bytes: int  # bytes per activation element
    virtual: int  # pipeline stages per rank (2 interleaved)
    dense: float  # parameters on one rank that ZeRO shards and the gradient reduction carries (not ep's experts)
    experts: float  # routed-expert parameters on one rank when they are split apart (ep), else 0


# ring collectives: an all-reduce moves 2(n-1)/n of the buffer per rank, the others (n-1)/n
def data_parallel_bytes(step):
    """dp: the gradients reduced over the gradient-reducing ranks (dp x cp: the cp ranks hold the same weights), by
    all-reduce (DDP, ZeRO-1) or reduce-scatter, with the weights gathered once per step (ZeRO-2) or in forward and
    again in backward (ZeRO-3)."""
    comm, shard, grad_buffer = {}, grad_reduce_factor(step.sizes), 4 * step.dense
    if shard > 1:
        ring = (shard - 1) / shard
        if step.zero_stage <= 1:
            comm["dp_allreduce"] = 2 * ring * grad_buffer
        else:
            comm["dp_reduce_scatter"] = ring * grad_buffer
            comm["dp_allgather"] = ring * grad_buffer * (2 if step.zero_stage >= 3 else 1)
    return comm


def pipeline_bytes(step):
    """pp: each micro-batch sends its hidden state forward and its gradient backward per stage boundary."""
    if step.sizes["pp"] == 1:
        return {}
    h, m = step.config.hidden_size, step.microbatches
    return {"pp_p2p": 2 * m * step.tokens * h * step.act_bytes * step.virtual}


def context_parallel_bytes(step):
    """cp: ring attention, K and V pass cp-1 hops forward; backward passes K, V and dK, dV."""
    cp = step.sizes["cp"]
    if cp == 1:
        return {}
    kv_dim = step.config.num_key_value_heads * step.config.head_dim
    kv_block = 2 * step.tokens * kv_dim * step.act_bytes
    return {"cp_kv_ring": 3 * (cp - 1) * kv_block * step.layers * step.microbatches}


def tensor_parallel_bytes(step):
    """tp: 2 all-reduces forward (attention and MLP outputs) + 2 backward per layer per micro-batch; when the routed
    experts are split apart (ep) they are whole on each tp rank (ETP=1): attention and shared experts reduce only."""
    tp, config = step.sizes["tp"], step.config
    if tp == 1:
        return {}
    per_layer = 2 + 2 * config.n_shared_experts if config.use_moe and divisor(step.sizes, "experts") > 1 else 4
    return {"tp_allreduces_per_layer": per_layer,
            "tp_allreduce": per_layer * step.layers * step.microbatches * 2 * (tp - 1) / tp * step.tokens
            * config.hidden_size * step.act_bytes}


def expert_parallel_bytes(step):
    """ep: each MoE layer's token rows (top-k slots per token; under cp the rank's part of each sequence) out to their
    experts' ranks and back, (ep-1)/ep of them leaving the rank, in forward and the same in backward; and the experts'
    gradients all-reduced over their replicas (the gradient-reducing ranks / ep: the cp peers hold the same experts)."""
    comm, ep, config = {}, step.sizes["ep"], step.config
    if ep > 1:
        rows = step.tokens * config.num_experts_per_tok
        comm["ep_alltoall"] = 2 * (2 * rows * config.hidden_size * step.act_bytes * (ep - 1) / ep) * step.layers \
            * step.microbatches
    replicas = grad_reduce_factor(step.sizes) // ep
    if replicas > 1 and step.experts:  # a dense model has no experts to reduce
        comm["ep_replica_allreduce"] = 2 * (replicas - 1) / replicas * 4 * step.experts
    return comm


# each dimension's bytes per rank per optimizer step, by DIMENSIONS name; a new dimension adds its function here
COMMUNICATION = {"dp": data_parallel_bytes, "pp": pipeline_bytes, "cp": context_parallel_bytes,
                 "tp": tensor_parallel_bytes, "ep": expert_parallel_bytes}


def communication(step):
    """Bytes per rank per optimizer step, every dimension's terms in DIMENSIONS order."""
    comm = {}
    for dimension in DIMENSIONS:
        if dimension.name not in COMMUNICATION:
            raise KeyError(f"dimension {dimension.name} has no communication term in scripts/planner/cost.py "
                           "COMMUNICATION")
        comm.update(COMMUNICATION[dimension.name](step))
    return comm


def state_bytes(dense, experts, shard, zero_stage):
    """(weights, gradients, optimizer) bytes on one rank: fp32 master weights, fp32 gradients, two fp32 AdamW moments;
    ZeRO stage 3/2/1 shards them over `shard` ranks, the dense parameters only (ep's experts stay whole)."""
    weight_bytes = 4 * (dense / (shard if zero_stage >= 3 else 1) + experts)
    grad_bytes = 4 * (dense / (shard if zero_stage >= 2 else 1) + experts)
    optim_bytes = 8 * (dense / (shard if zero_stage >= 1 else 1) + experts)
    return weight_bytes, grad_bytes, optim_bytes


def expert_weight_copies(config, sizes):
    """Elements a MoE layer saves for backward whatever its tokens: the grouped GEMMs stack the rank's experts'
    gate, up and down weights into one tensor each per forward, in the compute dtype (model/model_minimind.py
    MOEFeedForward.grouped_experts), and autograd keeps them until that layer's backward; split with the experts (ep)
    or, kept whole, with the matrices (tp). 0 for a dense MLP. (Where torch has no grouped matmul for the device the
    experts run as a loop and keep no copy: the estimate is then this much high.)"""
    if not config.use_moe:
        return 0
    experts = divisor(sizes, "experts")
    split = experts if experts > 1 else divisor(sizes, "matrices")
    return 3 * config.num_experts * config.hidden_size * config.moe_intermediate_size / split


def activation_bytes(config, sizes, tokens, layers, act_bytes, grad_checkpointing, sequence_parallel,
                     loss_chunk_size):
    """(saved activations of one micro-batch, logits and their gradient) in bytes on one rank."""
    h = config.hidden_size
    per_token_layer = activation_elements(config, sizes, sequence_parallel) * act_bytes
    per_layer = expert_weight_copies(config, sizes) * act_bytes
    if grad_checkpointing:  # keep each block's input, recompute one block at a time in backward
        microbatch = tokens * (layers * h * act_bytes + per_token_layer) + per_layer
    else:
        microbatch = tokens * layers * per_token_layer + layers * per_layer
    # fp32 logits + their gradient, over the whole micro-batch or one chunk; the vocabulary matrix split as the others
    rows = min(tokens, loss_chunk_size) if loss_chunk_size else tokens
    return microbatch, 2 * 4 * rows * config.vocab_size / divisor(sizes, "matrices")


def plan_layout(config, seq_len, micro_batch, num_microbatches, layout=None, zero_stage=0, pp_schedule="1f1b",
                act_bytes=4, grad_checkpointing=False, sequence_parallel=False, loss_chunk_size=0):
    """Memory per rank and communication per optimizer step for one layout (formulas: docs/scaling.md).

    layout: the sizes by dimension name ({"dp": 2, "tp": 2}; missing ones 1) or the plan's Layout. Bytes throughout,
    act_bytes per activation element (4 fp32, 2 under bf16 autocast). The worst pipeline stage: its layers and one
    vocabulary matrix (the first stage embeds, the last projects). Split apart (ep), the routed experts are whole on
    every tp rank (ETP=1), carved out of dp: under DDP their gradients are reduced over their dp*cp/ep replicas.
    """
    sizes = layout_sizes(layout)
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    total_params = L * layer_params(config) + V * h + h  # tied lm_head counted once, final norm
    stages, expert_split = divisor(sizes, "layers"), divisor(sizes, "experts")
    layers_rank = math.ceil(L / stages)
    routed = layers_rank * routed_expert_params(config) if expert_split > 1 else 0
    experts_rank = routed / expert_split
    params_rank = (layers_rank * layer_params(config) + V * h - routed) / divisor(sizes, "matrices") + experts_rank
    dense = params_rank - experts_rank
    weight_bytes, grad_bytes, optim_bytes = state_bytes(dense, experts_rank, grad_reduce_factor(sizes), zero_stage)
    tokens = micro_batch * seq_len / divisor(sizes, "tokens")  # tokens of one micro-batch on one rank
    act_microbatch, logits_bytes = activation_bytes(config, sizes, tokens, layers_rank, act_bytes,
                                                    grad_checkpointing, sequence_parallel, loss_chunk_size)
    virtual = 2 if pp_schedule == "interleaved1f1b" else 1
    m = num_microbatches
    in_flight = 1 if stages == 1 else (m if pp_schedule == "gpipe" else min(m, stages))
    act_bytes_rank = in_flight * act_microbatch + logits_bytes
    comm = communication(Step(config, sizes, tokens, layers_rank, m, zero_stage, act_bytes, virtual, dense,
                              experts_rank))
    return dict(total_params=total_params, params_per_rank=params_rank,
                memory_gb=dict(weights=weight_bytes / GB, grads=grad_bytes / GB, optimizer=optim_bytes / GB,
                               activations_per_microbatch=act_microbatch / GB, logits=logits_bytes / GB,
                               microbatches_in_flight=in_flight, activations=act_bytes_rank / GB,
                               total=(weight_bytes + grad_bytes + optim_bytes + act_bytes_rank) / GB),
                comm_gb_per_step={k: (v / GB if not k.endswith("_per_layer") else v) for k, v in comm.items()},
                bubble_fraction=(stages - 1) / (virtual * m + stages - 1) if stages > 1 else 0.0)
