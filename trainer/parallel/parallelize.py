"""Applies the parallel dimensions to a plain model in a fixed order (torchtitan's parallelize_llama).

Order: pipeline split -> tensor parallel -> context parallel -> activation checkpointing -> compile
-> data parallel (DDP / ZeRO).
Every function here is a no-op for a single process, so the single-process path is the plain model.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.trainer_utils import ConfigError, Logger


def add_parallel_args(parser):
    a = parser.add_argument
    a("--tp", type=int, default=1, help="tensor-parallel degree")
    a("--pp", type=int, default=1, help="pipeline-parallel degree (micro-batches = --accumulation_steps)")
    a("--cp", type=int, default=1, help="context-parallel (ring attention) degree")
    a("--pp_schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved1f1b"])
    a("--sequence_parallel", type=int, default=0, choices=[0, 1], help="shard norms along the sequence (tp > 1)")
    a("--zero_stage", type=int, default=0, help="0: DDP, 1: sharded optimizer, 2: +gradients, 3: +parameters (FSDP2)")
    a("--grad_compression", default="none", help="none|bf16|powersgd (DDP communication hook)")


def check_parallel_args(args, config, world_size):
    """Layout checks that must pass on every rank before the first collective."""
    from trainer.parallel.mesh import validate_layout
    dp, message = validate_layout(world_size, tp=args.tp, pp=args.pp, cp=args.cp)
    if message:
        raise ConfigError(message)
    args.dp = dp
    if args.tp > 1:
        from trainer.parallel.tensor import tp_validate
        message = tp_validate(config, args.tp, seq_len=args.max_seq_len // args.cp if args.sequence_parallel else None)
        if message:
            raise ConfigError(message)
    if args.cp > 1 and args.max_seq_len % (2 * args.cp):
        raise ConfigError(f"--max_seq_len {args.max_seq_len} must be divisible by 2*cp = {2 * args.cp} "
                          "(each rank holds a head and a tail chunk); change --max_seq_len or --cp")
    if args.pp > 1:
        from trainer.parallel.pipeline import pp_validate
        message = pp_validate(config.num_hidden_layers, args.pp, args.pp_schedule, args.accumulation_steps)
        if message:
            raise ConfigError(message)
    if (args.tp > 1 or args.pp > 1) and args.dp * args.cp > 1 and args.zero_stage == 0 and args.grad_compression == "none":
        # DDP handles neither DTensor (tp) parameters nor a pipeline schedule's backward; FSDP2 does both
        Logger("tp/pp with dp*cp > 1: data parallel uses FSDP2 with gathered parameters (--zero_stage 2)")
        args.zero_stage = 2
    from trainer.parallel.data import validate_data_parallel
    message = validate_data_parallel(args.zero_stage, args.grad_compression, dp=args.dp * args.cp, tp=args.tp, pp=args.pp)
    if message:
        raise ConfigError(message)
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence_parallel 1 needs --tp > 1")
    if args.sequence_parallel and args.pp > 1:
        raise ConfigError("--sequence_parallel 1 with --pp > 1 is not supported yet; drop one of them")
    if args.pp > 1 and args.eval_data_path:
        raise ConfigError("--eval_data_path with --pp > 1 is not supported yet; validate with a pp=1 run")
    if args.pp > 1 and args.use_compile:
        raise ConfigError("--use_compile 1 with --pp > 1 is not supported; drop one of them")


@dataclass
class Run:
    """Where this process sits in the layout and what it trains."""
    device: str
    dims: object = None  # mesh.ParallelDims when distributed
    dp_rank: int = 0
    model: torch.nn.Module = None  # the plain full model (before wrapping)
    model_parts: list = field(default_factory=list)  # what this rank trains (pipeline stages or [model])
    schedule: object = None  # pipeline schedule when pp > 1
    pipeline: object = None  # pipeline helper state (loss recording, tied weights)
    has_dtensor: bool = False
    counts_loss: bool = True  # this rank's CE partial sums count in the global loss (last stage, tp rank 0)
    counts_items: bool = True  # this rank's token counts count once per dp rank (cp/tp rank 0, last stage)

    def size(self, name):
        return getattr(self.dims, name, 1) if self.dims is not None else 1

    def group(self, name):
        return getattr(self.dims, f"{name}_group", None) if self.dims is not None else None


def setup_parallel(args, config):
    """Build the device mesh (when launched with torchrun) and this rank's Run."""
    run = Run(device=args.device)
    if not dist.is_initialized():
        return run
    from trainer.parallel.mesh import ParallelDims, build_mesh
    run.dims = ParallelDims.from_mesh(*build_mesh(args.dp, args.pp, args.cp, args.tp, torch.device(args.device).type))
    run.dp_rank = run.dims.dp_rank
    last_stage = run.dims.pp_rank == args.pp - 1
    run.counts_loss = last_stage and run.dims.tp_rank == 0
    run.counts_items = run.counts_loss and run.dims.cp_rank == 0
    Logger(run.dims.summary())
    return run


def wrap_model(run, args, config, model_state=None):
    """Load resume weights into the plain model, then apply pp -> tp -> cp -> compile -> dp."""
    from trainer.trainer_utils import init_model
    model, _ = init_model(config, args.tokenizer_path, args.from_weight, args.save_dir, "cpu")
    if model_state is not None:
        model.load_state_dict(model_state)
    model = model.to(run.device)
    run.model = model
    parts = [model]
    if args.pp > 1:
        from trainer.parallel.pipeline import Pipeline
        run.pipeline = Pipeline(model, run.group("pp"), args.pp_schedule, args.accumulation_steps, run.device,
                                micro_batch_shape=(args.batch_size, args.max_seq_len // args.cp),
                                autocast_dtype=None if args.torch_dtype == torch.float32 else args.torch_dtype)
        parts = run.pipeline.stage_modules
    if args.tp > 1:
        from trainer.parallel.tensor import apply_tensor_parallel
        for part in parts:
            # a pipeline schedule computes the loss itself: gather the last stage's logits there
            apply_tensor_parallel(part, run.dims.tp_mesh, sequence_parallel=bool(args.sequence_parallel),
                                  loss_parallel=args.pp == 1)
        run.has_dtensor = True
    if args.cp > 1:
        from trainer.parallel.context import apply_context_parallel
        for part in parts:
            apply_context_parallel(part, run.dims.cp_mesh)
    if args.grad_checkpointing:
        from trainer.perf import apply_activation_checkpointing
        for part in parts:
            apply_activation_checkpointing(part)
    if args.use_compile:
        from trainer.perf import compile_blocks
        for part in parts:
            compile_blocks(part)
    if run.dims is not None and run.dims.dp * run.dims.cp > 1:
        from trainer.parallel.data import apply_data_parallel
        parts = [apply_data_parallel(part, run.dims, args.zero_stage, args.grad_compression) for part in parts]
        run.has_dtensor = run.has_dtensor or args.zero_stage >= 2
    run.model_parts = parts
    if args.pp > 1:
        run.schedule = run.pipeline.make_schedule(parts)


def build_optimizer(params, args, run, fused):
    from trainer.parallel.data import build_optimizer as build
    return build(params, lr=args.learning_rate, weight_decay=args.weight_decay, zero_stage=args.zero_stage,
                 dims=run.dims, fused=fused)


def full_state(run, optimizer):
    """(model, optimizer) full FQN-keyed fp32 state dicts on rank 0 (None elsewhere); collective."""
    from trainer.parallel.utils import full_model_state_dict, full_optimizer_state_dict
    pp_group = run.group("pp") if run.size("pp") > 1 else None
    model_sd = full_model_state_dict(run.model_parts, pp_group=pp_group)
    optim_sd = full_optimizer_state_dict(run.model_parts, [optimizer], pp_group=pp_group, tied_aliases=tied_aliases(run))
    return model_sd, optim_sd


def tied_aliases(run):
    """Under pp the tied embedding has a copy on the last stage; its optimizer state is saved once."""
    from trainer.parallel.utils import TIED_EMBEDDING
    return TIED_EMBEDDING if run.pipeline is not None and run.model.config.tie_word_embeddings else None


def load_optimizer(run, optimizer, optim_sd):
    from trainer.parallel.utils import load_full_state
    load_full_state(run.model_parts, [optimizer], None, optim_sd, tied_aliases=tied_aliases(run))
