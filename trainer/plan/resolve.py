"""resolve(args, world_size) -> the one frozen TrainPlan the trainer reads (trainer/plan/sections.py: its sections),
after checking every flag: the one place the flags are read.

Nothing is created (writability is checked on the nearest existing folder); it logs what it decides for the user
(the zero stage a layout needs, the tokenizer a --from_weight file records, sizes a weights file overrides).
"""
import os
from dataclasses import replace

import torch

from dataset.mixture import absolute_data_spec
from model.errors import ConfigError, check_device
from model.provenance import tokenizer_record
from model.tokenizer_choice import TokenizerMismatch, check_tokenizer, tokenizer_for
from model.weights.paths import (
    repo_path,
    typed_or_default,
    weight_name,
    weight_path,
)
from trainer.base.log import Logger
from trainer.base.schema import fill
from trainer.ckpt.step_dirs import MANIFEST
from trainer.ckpt.weights_file import any_weights_record
from trainer.observe.tracking import resolve_trackers
from trainer.parallel.mesh import MODEL_DIMS
from trainer.plan.checks import (
    check_combinations,
    check_metrics_file,
    check_model_args,
    check_numbers,
    check_parallel_args,
    check_paths,
    check_replica_layout,
    data_parallel_mode,
    resolve_dtype,
)
from trainer.plan.flags import declared_flags
from trainer.plan.model_config import build_config, check_vocab, weight_shapes
from trainer.plan.sections import DataPlan, GuardPlan, IOPlan, Layout, ModelPlan, Schedule, TrainPlan
from trainer.plan.stage import Stage
from trainer.runtime.callbacks import resolve_callbacks
from trainer.runtime.optimizer_choice import resolve_optimizer
from trainer.runtime.schedule import resolve_schedule


def resolve(args, world_size, local_rank=0, stage=Stage):
    """Check the flags and derive the frozen TrainPlan, section by section (trainer/plan/sections.py); raises
    ConfigError before any collective.

    stage: the Stage class (trainer/plan/stage.py) whose resolve(args, plan) gives the stage's checked plan,
    plan.stage."""
    check_numbers(args, declared_flags(stage))
    check_device(args.device)
    save_dir = typed_or_default(args.save_dir, "out")
    from_weight = weight_path(args.from_weight, save_dir, build_config(args))
    data_path, eval_data_path = (absolute_data_spec(spec) if spec else None
                                 for spec in (args.data_path, args.eval_data_path))
    checkpoint_dir = typed_or_default(args.checkpoint_dir, "checkpoints")
    cache_dir = typed_or_default(args.cache_dir, os.path.join("dataset", ".cache"))
    trackers, tensorboard_dir = resolve_trackers(args, save_dir)
    log_dir = None if args.log_dir == "none" else typed_or_default(args.log_dir, None) or os.path.join(save_dir, "logs")
    outputs = [(checkpoint_dir, "--checkpoint_dir"), (cache_dir, "--cache_dir")]
    check_paths(save_dir, from_weight, (("--data_path", data_path), ("--eval_data_path", eval_data_path)),
                outputs + ([(tensorboard_dir, "--tensorboard_dir")] if tensorboard_dir else [])
                + ([(log_dir, "--log_dir")] if log_dir else []))
    tokenizer_path = run_tokenizer(args, from_weight)
    check_tokenizer(tokenizer_path)
    config = build_config(args, weight_shapes(args, from_weight) if from_weight != "none" else {}, tokenizer_path)
    check_vocab(config, tokenizer_path, from_weight)
    check_model_args(args, config)
    model = resolve_model(args, config, from_weight)
    layout = resolve_layout(args, world_size, local_rank, config)
    name = weight_name(args.save_weight, config)
    metrics_file = typed_or_default(args.metrics_file, None) or os.path.join(save_dir, f"{name}_metrics.jsonl")
    check_metrics_file(metrics_file)
    global_batch = args.batch_size * args.accumulation_steps * layout.dp
    plan = TrainPlan(  # the sections in the order their checks ran before the plan had sections
        layout=layout, model=model,
        data=fill(DataPlan, args, data_path=data_path, eval_data_path=eval_data_path, seq_len=args.max_seq_len,
                  micro_batch=args.batch_size, num_microbatches=args.accumulation_steps, global_batch=global_batch,
                  doc_mask=bool(args.packing and args.doc_mask), cache_dir=cache_dir, tokenizer_path=tokenizer_path,
                  tokenizer_record=tokenizer_record(tokenizer_path)),
        io=fill(IOPlan, args, save_dir=save_dir, checkpoint_dir=checkpoint_dir, run_name=name,
                weights_path=os.path.join(save_dir, name + ".pth"), run_dir=os.path.join(checkpoint_dir, name),
                save_dtype=getattr(torch, args.save_dtype), **resume_flags(args.from_resume), metrics_file=metrics_file,
                tensorboard_dir=tensorboard_dir, trackers=trackers, log_dir=log_dir,
                profile_steps=profile_steps(args.profile_steps)),
        lr=resolve_schedule(args, global_batch), optim=resolve_optimizer(args, has_dtensor=layout.has_dtensor),
        callbacks=resolve_callbacks(args, has_eval=eval_data_path is not None),
        schedule=fill(Schedule, args), guard=fill(GuardPlan, args), flags=dict(vars(args)))
    if eval_data_path and not stage.has_eval:
        raise ConfigError(f"--eval_data_path: {stage.name} logs its rewards instead of a held-out LM loss; "
                          "leave it out")
    stage_plan = stage.resolve(args, plan)
    seq_len = stage_plan.sequence_length(args.max_seq_len)  # RL: prompt + completion
    return replace(plan, stage=stage_plan, data=replace(plan.data, seq_len=seq_len))


def resolve_layout(args, world_size, local_rank, config):
    """The Layout section: the data-parallel degree and mode a layout gives, its checks, this rank's device."""
    dp, zero_stage, dp_mode = data_parallel_mode(world_size, args.zero_stage, args.grad_compression,
                                                 **{name: getattr(args, name) for name in MODEL_DIMS})
    check_parallel_args(args, config, zero_stage)
    check_combinations(args)
    check_replica_layout(args.check_replicas, dp_mode)
    check_offload(args, dp_mode)
    if zero_stage != args.zero_stage:
        Logger(f"tp/pp with dp*cp > 1: data parallel uses FSDP2 with gathered parameters (zero stage {zero_stage})")
    device = f"cuda:{local_rank}" if world_size > 1 and args.device.startswith("cuda") else args.device
    return fill(Layout, args, world_size=world_size, dp=dp, zero_stage=zero_stage, dp_mode=dp_mode, device=device)


def resolve_model(args, config, from_weight):
    """The ModelPlan section: the model config, its starting weights, the dtype (measured for --dtype auto)."""
    dtype, dtype_note = resolve_dtype(args.dtype, args.device)
    check_router_balance(args, config)
    check_expert_compute(args, config, dtype)
    return fill(ModelPlan, args, config=config, from_weight=from_weight, dtype=dtype,
                dtype_note=dtype_note if args.dtype == "auto" else "",
                # chunked loss: not under tp (vocab-sharded logits) nor pp (the schedule takes the last stage's logits)
                chunked_loss=args.loss_chunk_size > 0 and args.tp == 1 and args.pp == 1,
                grad_checkpointing=checkpoint_mode(args.grad_checkpointing))


def run_tokenizer(args, from_weight):
    """The run's tokenizer folder: --tokenizer_path, else the one --from_weight was trained with (its record), else
    model/; a typed folder whose tokenizer.json differs from the recorded one is refused (--force_tokenizer 1: kept)."""
    record = any_weights_record(from_weight).get("tokenizer") if from_weight != "none" else None
    if record is None:
        return typed_or_default(args.tokenizer_path, "model")
    try:
        folder, note = tokenizer_for(record, typed_or_default(args.tokenizer_path, None), repo_path("model"),
                                     f"--from_weight {from_weight}", bool(args.force_tokenizer))
    except TokenizerMismatch as e:
        raise ConfigError(str(e)) from None
    if note:
        Logger(note)
    return folder


def check_router_balance(args, config):
    """--router_balance needs a MoE model and a positive rate; bias alone turns MiniMind's aux loss off."""
    if args.router_balance != "aux" and not config.use_moe:
        raise ConfigError(f"--router_balance {args.router_balance} balances MoE experts: add --use_moe 1 or drop it")
    if args.router_balance != "aux" and not args.router_bias_rate > 0:
        raise ConfigError(f"--router_bias_rate must be > 0 (got {args.router_bias_rate})")
    if args.router_balance == "bias":
        config.router_aux_loss_coef = 0.0  # the bias balances alone (recorded in the weights' sidecar)


def check_expert_compute(args, config, dtype):
    """--expert_compute grouped needs a MoE model, experts not sharded by tensor parallel (tp without --ep: their
    sharded Linears run the loop) and a grouped matmul that runs on this device and dtype (the model's probe)."""
    if args.expert_compute == "auto":
        return
    if not config.use_moe:
        raise ConfigError(f"--expert_compute {args.expert_compute} runs MoE experts: add --use_moe 1 or drop it")
    if args.expert_compute == "grouped" and args.tp > 1 and args.ep == 1:
        raise ConfigError("--expert_compute grouped: tensor parallel without --ep shards each expert's Linears, "
                          "which run in the loop; add --ep, drop --tp or use --expert_compute loop/auto")
    if args.expert_compute != "grouped":
        return
    from model.moe import expert_compute_for  # the MoE layer's probe: read by runs that ask for grouped experts only
    if expert_compute_for(args.device, dtype, config.hidden_size, config.moe_intermediate_size) != "grouped":
        raise ConfigError(f"--expert_compute grouped: torch {torch.__version__} has no grouped matmul for "
                          f"{str(dtype)[6:]} on {args.device}; use --expert_compute loop or auto")


def checkpoint_mode(value):
    """--grad_checkpointing as the plan's mode: None, "full", "attention" or "mlp" (MiniMind's 0/1: off, full)."""
    mode = {"0": None, "none": None, "1": "full"}.get(str(value), str(value))
    if mode not in (None, "full", "attention", "mlp"):
        raise ConfigError(f"--grad_checkpointing must be 0, 1, none, full, attention or mlp (got {value})")
    return mode


def resume_flags(spec):
    """--from_resume 0|1|auto, or a step_<N> directory (a complete checkpoint) to continue from."""
    if spec in ("0", "1", "auto"):
        return dict(from_resume=spec, resume_path=None)
    path = typed_or_default(spec, None)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise ConfigError(f"--from_resume {spec}: not a complete checkpoint (a step_<N> directory with {MANIFEST}); "
                          "pass 0, 1, auto or such a directory")
    return dict(from_resume="1", resume_path=path)


def check_offload(args, dp_mode):
    """--cpu_offload: FSDP2's CPUOffloadPolicy, which moves shards between the GPU and the CPU."""
    if not args.cpu_offload:
        return
    if not args.device.startswith("cuda"):
        raise ConfigError("--cpu_offload 1 moves FSDP2's shards from the GPU to CPU memory; on --device cpu they are "
                          "in CPU memory already: drop --cpu_offload")
    if dp_mode != "fsdp2":
        raise ConfigError("--cpu_offload 1 offloads FSDP2's shards: use --zero_stage 2 or 3 with more than one "
                          "data-parallel process")


def profile_steps(spec):
    """--profile_steps A:B as (A, B), or None; a bad spec is a ConfigError. The profiler's module is read when the
    flag is given only."""
    if not spec:
        return None
    try:
        from trainer.observe.step_profiler import parse_profile_steps  # read by the runs that give the flag only
        return parse_profile_steps(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None
