"""The layout model: memory per rank and communication per step of a parallel layout, and docs/scaling.md's tables.

    python scripts/bench.py --plan --nproc 64 --tp 4 --pp 4 --hidden_size 2048 --num_hidden_layers 32
    python scripts/layout_model.py                                             # docs/scaling.md's tables

Estimates (formulas: docs/scaling.md); tests/test_bench.py checks the memory against a measured run.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch and the trainer's plan")

from model.model_minimind import MiniMindConfig  # noqa: E402
from trainer.plan.checks import data_parallel_mode  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here


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


def expert_communication(config, tokens, layers_rank, m, dp, ep, act_bytes, expert_params_rank, cp=1):
    """Bytes per rank per step of expert parallel: each MoE layer's token rows (top-k slots per token; under cp the
    rank's part of each sequence) out to their experts' ranks and back, (ep-1)/ep of them leaving the rank, in forward
    and the same in backward; and the experts' gradients all-reduced over their dp*cp/ep replicas."""
    comm = {}
    if ep > 1:
        rows = tokens * config.num_experts_per_tok
        comm["ep_alltoall"] = 2 * (2 * rows * config.hidden_size * act_bytes * (ep - 1) / ep) * layers_rank * m
    replicas = dp * cp // ep  # the cp peers hold the same experts and see the other parts of the sequences
    if replicas > 1:
        comm["ep_replica_allreduce"] = 2 * (replicas - 1) / replicas * 4 * expert_params_rank
    return comm


def activation_elements(config, tp, sequence_parallel, ep=1):
    """Saved activation elements per token per layer on one tp rank (measured on MiniMindBlock, within 1%).

    12h + 2 kv + 4 I; the 4h of norm inputs/outputs stay replicated under tp unless sequence parallel; under ep the
    routed experts' 4 I per slot are whole on every tp rank (ETP=1: not tensor-parallel).
    """
    h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    if not config.use_moe:
        split_width, whole_width = config.intermediate_size, 0
    else:
        routed = config.moe_intermediate_size * config.num_experts_per_tok
        split_width = config.moe_intermediate_size * config.n_shared_experts + (routed if ep == 1 else 0)
        whole_width = routed if ep > 1 else 0
    return 4 * h / (tp if sequence_parallel else 1) + (8 * h + 2 * kv_dim + 4 * split_width) / tp + 4 * whole_width


def communication(config, params_rank, tokens, layers_rank, m, dp, tp, pp, cp, zero_stage, act_bytes, virtual,
                  ep=1):
    """Bytes per rank per optimizer step by dimension (ring collectives: all-reduce 2(n-1)/n, the others (n-1)/n)."""
    h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    comm, shard, grad_buffer = {}, dp * cp, 4 * params_rank
    if shard > 1:
        ring = (shard - 1) / shard
        if zero_stage <= 1:
            comm["dp_allreduce"] = 2 * ring * grad_buffer
        else:
            comm["dp_reduce_scatter"] = ring * grad_buffer
            # ZeRO-2 gathers weights once per step, ZeRO-3 in forward and again in backward
            comm["dp_allgather"] = ring * grad_buffer * (2 if zero_stage >= 3 else 1)
    if tp > 1:  # 2 all-reduces forward (attention and MLP outputs) + 2 backward per layer per micro-batch
        # under ep the routed experts are whole on each tp rank (ETP=1): only attention and shared experts reduce
        per_layer = 2 + 2 * config.n_shared_experts if config.use_moe and ep > 1 else 4
        comm["tp_allreduces_per_layer"] = per_layer
        comm["tp_allreduce"] = per_layer * layers_rank * m * 2 * (tp - 1) / tp * tokens * h * act_bytes
    if pp > 1:  # each micro-batch sends its hidden state forward and its gradient backward per boundary
        comm["pp_p2p"] = 2 * m * tokens * h * act_bytes * virtual
    if cp > 1:  # ring attention: K and V pass cp-1 hops forward; backward passes K, V and dK, dV
        kv_block = 2 * tokens * kv_dim * act_bytes
        comm["cp_kv_ring"] = 3 * (cp - 1) * kv_block * layers_rank * m
    return comm


def plan_layout(config, seq_len, micro_batch, num_microbatches, dp=1, tp=1, pp=1, cp=1, zero_stage=0,
                pp_schedule="1f1b", act_bytes=4, grad_checkpointing=False, sequence_parallel=False, loss_chunk_size=0,
                ep=1):
    """Memory per rank and communication per optimizer step for one layout (formulas: docs/scaling.md).

    Bytes throughout. fp32 master weights, fp32 grads and two fp32 AdamW moments (what the trainer keeps);
    act_bytes = bytes per activation element (4 fp32, 2 under bf16 autocast). ep: routed experts / ep per rank
    (carved out of dp, under DDP: the experts' gradients are reduced over their dp*cp/ep replicas, not over dp*cp);
    with tp they are whole on every tp rank (ETP=1), each tp rank sending its (replicated) tokens' rows by all-to-all;
    with pp the experts and all-to-alls of the rank's stage's layers only.
    """
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    total_params = L * layer_params(config) + V * h + h  # tied lm_head counted once, final norm
    layers_rank = math.ceil(L / pp)
    # under ep the routed experts are whole, not tensor-parallel (ETP=1): 1/ep of them on every tp rank
    routed = layers_rank * routed_expert_params(config) if ep > 1 else 0
    experts_rank = routed / ep
    # worst pipeline stage: L/pp layers + one vocab matrix (first stage embeds, last stage projects)
    params_rank = (layers_rank * layer_params(config) + V * h - routed) / tp + experts_rank
    shard = dp * cp  # the data-parallel group (cp ranks hold the same weights)
    dense = params_rank - experts_rank  # ZeRO shards these; ep's experts stay whole on their ranks
    weight_bytes = 4 * (dense / (shard if zero_stage >= 3 else 1) + experts_rank)
    grad_bytes = 4 * (dense / (shard if zero_stage >= 2 else 1) + experts_rank)
    optim_bytes = 8 * (dense / (shard if zero_stage >= 1 else 1) + experts_rank)

    tokens = micro_batch * seq_len / cp  # tokens of one micro-batch on one rank
    per_token_layer = activation_elements(config, tp, sequence_parallel, ep) * act_bytes
    if grad_checkpointing:  # keep each block's input, recompute one block at a time in backward
        act_microbatch = tokens * (layers_rank * h * act_bytes + per_token_layer)
    else:
        act_microbatch = tokens * layers_rank * per_token_layer
    # fp32 logits + their gradient, over the whole micro-batch or one chunk
    logits_bytes = 2 * 4 * (min(tokens, loss_chunk_size) if loss_chunk_size else tokens) * V / tp
    virtual = 2 if pp_schedule == "interleaved1f1b" else 1
    m = num_microbatches
    in_flight = 1 if pp == 1 else (m if pp_schedule == "gpipe" else min(m, pp))
    act_bytes_rank = in_flight * act_microbatch + logits_bytes
    # under ep the dp all-reduce carries the dense parameters only
    comm = communication(config, dense, tokens, layers_rank, m, dp, tp, pp, cp, zero_stage,
                         act_bytes, virtual, ep)
    comm.update(expert_communication(config, tokens, layers_rank, m, dp, ep, act_bytes, experts_rank, cp))
    gb = 2 ** 30
    return dict(total_params=total_params, params_per_rank=params_rank,
                memory_gb=dict(weights=weight_bytes / gb, grads=grad_bytes / gb, optimizer=optim_bytes / gb,
                               activations_per_microbatch=act_microbatch / gb, logits=logits_bytes / gb,
                               microbatches_in_flight=in_flight, activations=act_bytes_rank / gb,
                               total=(weight_bytes + grad_bytes + optim_bytes + act_bytes_rank) / gb),
                comm_gb_per_step={k: (v / gb if not k.endswith("_per_layer") else v) for k, v in comm.items()},
                bubble_fraction=(pp - 1) / (virtual * m + pp - 1) if pp > 1 else 0.0)


# configurations of docs/scaling.md: name -> (model flags, seq_len, micro_batch, micro-batches)
SCALING_MODELS = {
    "MiniMind default (h768, 8 layers)": (dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                                               num_key_value_heads=4), 512, 16, 8),
    "500M (h1536, 20 layers)": (dict(hidden_size=1536, num_hidden_layers=20, num_attention_heads=12,
                                     num_key_value_heads=4), 2048, 4, 16),
    "1.5B (h2048, 32 layers)": (dict(hidden_size=2048, num_hidden_layers=32, num_attention_heads=16,
                                     num_key_value_heads=4), 2048, 2, 32),
}
SCALING_LAYOUTS = {8: [dict(), dict(zero_stage=2), dict(tp=2), dict(tp=2, pp=2), dict(cp=2, zero_stage=2)],
                   64: [dict(zero_stage=2), dict(tp=4), dict(tp=2, pp=4),
                        dict(tp=4, pp=2, pp_schedule="interleaved1f1b"),
                        dict(tp=2, pp=2, cp=2)]}


def plan_table():
    """docs/scaling.md's tables: plan_layout for SCALING_MODELS x SCALING_LAYOUTS (bf16 activations)."""
    lines = []
    for name, (model, seq_len, micro_batch, micro_batches) in SCALING_MODELS.items():
        config = MiniMindConfig(**model)
        lines += [f"\n### {name}: {plan_layout(config, seq_len, micro_batch, 1)['total_params'] / 1e6:.0f}M params, "
                  f"seq {seq_len}, micro-batch {micro_batch}, {micro_batches} micro-batches per step per dp rank\n",
                  "| GPUs | layout | weights+grads+Adam GiB | activations GiB | total GiB/rank "
                  "| dp GiB | tp GiB | pp GiB | cp GiB | bubble |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for gpus, layouts in SCALING_LAYOUTS.items():
            for layout in layouts:
                tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
                # as the trainer runs it
                dp, zero, _ = data_parallel_mode(gpus, layout.get("zero_stage", 0), tp=tp, pp=pp, cp=cp)
                schedule = layout.get("pp_schedule", "1f1b")
                plan = plan_layout(config, seq_len, micro_batch, micro_batches, dp, tp, pp, cp, zero, schedule,
                                   act_bytes=2)
                mem, comm = plan["memory_gb"], plan["comm_gb_per_step"]
                dp_gb = sum(v for k, v in comm.items() if k.startswith("dp_"))
                desc = f"dp{dp} tp{tp} pp{pp} cp{cp} zero{zero}" + (" interleaved" if schedule != "1f1b" else "")
                lines.append(f"| {gpus} | {desc} | {mem['weights'] + mem['grads'] + mem['optimizer']:.2f} | "
                             f"{mem['activations']:.2f} | {mem['total']:.2f} | {dp_gb:.2f} | "
                             f"{comm.get('tp_allreduce', 0):.2f} | {comm.get('pp_p2p', 0):.2f} | "
                             f"{comm.get('cp_kv_ring', 0):.2f} | {plan['bubble_fraction']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(plan_table())
