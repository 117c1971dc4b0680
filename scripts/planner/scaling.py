"""docs/scaling.md's tables: the layout model (scripts/planner/cost.py) for three models on 8 and 64 GPUs, each layout
resolved as the trainer runs it, one column of bytes per dimension of trainer/parallel/mesh.py's DIMENSIONS."""
from model.model_minimind import MiniMindConfig
from scripts.planner.cost import layout_sizes, plan_layout
from trainer.parallel.mesh import DIMENSIONS
from trainer.plan.checks import data_parallel_mode

# name -> (model flags, seq_len, micro_batch, micro-batches)
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


def dimension_gb(comm, name):
    """GiB per step a dimension's collectives move (its `<name>_...` entries; a count per layer is not bytes)."""
    return sum(v for k, v in comm.items() if k.startswith(f"{name}_") and not k.endswith("_per_layer"))


def table_row(config, seq_len, micro_batch, micro_batches, gpus, layout):
    """One row: `layout` (model dimension sizes, zero_stage, pp_schedule) on `gpus`, dp and ZeRO as the trainer
    takes them, activations in bf16."""
    sizes = dict(layout)
    zero, schedule = sizes.pop("zero_stage", 0), sizes.pop("pp_schedule", "1f1b")
    dp, zero, _ = data_parallel_mode(gpus, zero, **sizes)
    sizes = layout_sizes(dict(sizes, dp=dp))
    plan = plan_layout(config, seq_len, micro_batch, micro_batches, sizes, zero_stage=zero, pp_schedule=schedule,
                       act_bytes=2)
    mem, comm = plan["memory_gb"], plan["comm_gb_per_step"]
    desc = " ".join(f"{name}{size}" for name, size in sizes.items()) + f" zero{zero}" \
        + (" interleaved" if schedule != "1f1b" else "")
    dims = "".join(f"{dimension_gb(comm, name):.2f} | " for name in sizes)
    return (f"| {gpus} | {desc} | {mem['weights'] + mem['grads'] + mem['optimizer']:.2f} | "
            f"{mem['activations']:.2f} | {mem['total']:.2f} | {dims}{plan['bubble_fraction']:.1%} |")


def plan_table():
    """docs/scaling.md's tables: plan_layout for SCALING_MODELS x SCALING_LAYOUTS (bf16 activations)."""
    lines = []
    for name, (model, seq_len, micro_batch, micro_batches) in SCALING_MODELS.items():
        config = MiniMindConfig(**model)
        lines += [f"\n### {name}: {plan_layout(config, seq_len, micro_batch, 1)['total_params'] / 1e6:.0f}M params, "
                  f"seq {seq_len}, micro-batch {micro_batch}, {micro_batches} micro-batches per step per dp rank\n",
                  "| GPUs | layout | weights+grads+Adam GiB | activations GiB | total GiB/rank | "
                  + "".join(f"{d.name} GiB | " for d in DIMENSIONS) + "bubble |",
                  "|---" * (6 + len(DIMENSIONS)) + "|"]
        for gpus, layouts in SCALING_LAYOUTS.items():
            lines += [table_row(config, seq_len, micro_batch, micro_batches, gpus, layout) for layout in layouts]
    return "\n".join(lines)
