"""resolve(args, world_size) -> the one frozen TrainPlan the trainer reads, after checking every flag.

No side effects: nothing is created; writability is checked on the nearest existing folder.
"""
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from dataset.mixture import absolute_data_spec
from model.model_minimind import MiniMindConfig
from model.provenance import tokenizer_record
from trainer.callbacks import CallbackPlan, resolve_callbacks
from trainer.checkpoint import MANIFEST
from trainer.checks import (
    check_combinations,
    check_device,
    check_metrics_file,
    check_model_args,
    check_numbers,
    check_parallel_args,
    check_paths,
    check_replica_layout,
    check_tokenizer,
    data_parallel_mode,
    resolve_dtype,
)
from trainer.launch import ConfigError
from trainer.model_config import build_config, weight_shapes
from trainer.optim import OptimizerPlan, resolve_optimizer
from trainer.schedule import LRSchedule, resolve_schedule
from trainer.tokenizer_choice import TokenizerMismatch, tokenizer_for
from trainer.tracking import parse_profile_steps, resolve_trackers
from trainer.trainer_utils import Logger, repo_path, typed_or_default, weight_name
from trainer.weights_file import any_weights_record


@dataclass(frozen=True)
class TrainPlan:
    """Everything derived from the flags, once: layout, data-parallel mode, dtype, device, batch, paths."""
    world_size: int
    dp: int
    tp: int
    pp: int
    cp: int
    zero_stage: int  # the stage actually used (tp/pp with data parallel needs FSDP2: at least 2)
    dp_mode: str  # "none" (no data-parallel group), "ddp", "zero1" or "fsdp2"
    grad_compression: str
    pp_schedule: str
    sequence_parallel: bool
    grad_checkpointing: Optional[str]  # None, "full" (decoder blocks), "attention" or "mlp" (that sub-layer)
    use_compile: bool
    device: str
    dtype: torch.dtype
    micro_batch: int  # samples per micro-batch per dp rank
    num_microbatches: int
    seq_len: int
    global_batch: int  # samples per optimizer step over all dp ranks
    chunked_loss: bool  # lm_head + CE on target tokens only (off under tp and pp)
    doc_mask: bool  # packed rows come with per-document position ids (attention within documents)
    save_dir: str
    checkpoint_dir: str
    metrics_file: str
    tokenizer_path: str
    tokenizer_record: dict  # {"path", "sha256" of its tokenizer.json}: written beside the weights and checkpoints
    cache_dir: str
    seed: int  # model init and data order
    data_path: Optional[str]  # a spec for dataset.mixture.resolve_data_spec; None: the embedded demo corpus
    eval_data_path: Optional[str]
    from_weight: str  # "none" or a .pth path
    tensorboard_dir: Optional[str]
    trackers: tuple  # dashboards besides the metrics JSONL: swanlab, wandb, tensorboard
    log_dir: Optional[str]  # each rank's rank_<N>.log; None: off
    profile_steps: Optional[tuple]
    weight_fields: dict  # model fields fixed by the --from_weight file (build_config(args, weight_fields))
    model_config: MiniMindConfig  # the model the flags (and the --from_weight file) describe
    run_name: str  # MiniMind's weight stem <save_weight>_<hidden>[_moe]
    weights_path: str  # <save_dir>/<run_name>.pth
    run_dir: str  # <checkpoint_dir>/<run_name>: this run's resume checkpoints
    save_dtype: torch.dtype
    from_resume: str  # "0", "1" or "auto"
    resume_path: Optional[str]  # --from_resume <step dir>: that checkpoint instead of the newest
    learning_rate: float  # as typed; the schedule's peak is lr.peak
    lr: LRSchedule  # trainer/schedule.py
    optim: OptimizerPlan  # trainer/optim.py
    callbacks: CallbackPlan  # trainer/callbacks.py: best checkpoint, early stopping, the user's
    grad_clip: float
    epochs: int
    max_steps: int  # 0: all epochs
    max_tokens: int  # 0: no token budget
    log_interval: Optional[int]  # None: MiniMind's 100, or fewer so that an epoch has ten records
    save_interval: int
    save_weights_every: int
    save_every_minutes: float  # 0: no time-based saves
    eval_interval: int
    eval_batches: int
    keep_checkpoints: int
    async_save: bool
    grace_seconds: float
    max_bad_steps: int
    check_replicas: int
    num_workers: int
    num_proc: Optional[int]
    packing: bool
    skip_bad_lines: bool
    dist_timeout: int
    dist_init_timeout: int
    powersgd_rank: int
    powersgd_start_step: int
    cpu_offload: bool
    deterministic: bool
    tf32: bool
    use_wandb: bool
    wandb_project: str
    flags: dict  # the flags as typed: saved in checkpoints and the tracker's config, never read by the trainer
    stage: object = None  # a post-training stage's own frozen plan (LoRA, DPO, distillation), else None
    dtype_note: str = ""  # how the dtype was chosen (--dtype auto: the measured rates), said once at start

    @property
    def micro_batch_shape(self):
        """(rows, tokens) of one micro-batch on one rank (tokens after context parallel's split); a stage may put
        several rows in one sample (DPO: a chosen/rejected pair), its plan says how many (rows_per_sample)."""
        return self.micro_batch * getattr(self.stage, "rows_per_sample", 1), self.seq_len // self.cp

    @property
    def has_dtensor(self):
        """Parameters are DTensors (tensor parallel or FSDP2): no fused AdamW, losses may be DTensors."""
        return self.tp > 1 or self.dp_mode == "fsdp2"

    @property
    def autocast_dtype(self):
        return None if self.dtype == torch.float32 else self.dtype


def resolve(args, world_size, local_rank=0, resolve_stage=None):
    """Check the flags and derive the frozen TrainPlan; raises ConfigError before any collective.

    resolve_stage(args, plan) -> the stage's own frozen plan (checked), kept as plan.stage."""
    check_numbers(args)
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
    weight_fields = weight_shapes(args, from_weight) if from_weight != "none" else {}
    config = build_config(args, weight_fields)
    check_model_args(args, config)
    dtype, dtype_note = resolve_dtype(args.dtype, args.device)
    dp, zero_stage, dp_mode = data_parallel_mode(world_size, args.tp, args.pp, args.cp, args.zero_stage,
                                                 args.grad_compression)
    check_parallel_args(args, config)
    check_combinations(args)
    check_replica_layout(args.check_replicas, dp_mode)
    check_offload(args, dp_mode)
    if zero_stage != args.zero_stage:
        Logger(f"tp/pp with dp*cp > 1: data parallel uses FSDP2 with gathered parameters (zero stage {zero_stage})")
    name = weight_name(args.save_weight, config)
    metrics_file = typed_or_default(args.metrics_file, None) or os.path.join(save_dir, f"{name}_metrics.jsonl")
    check_metrics_file(metrics_file)
    device = f"cuda:{local_rank}" if world_size > 1 and args.device.startswith("cuda") else args.device
    plan = TrainPlan(
        world_size=world_size, dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, zero_stage=zero_stage, dp_mode=dp_mode,
        grad_compression=args.grad_compression, pp_schedule=args.pp_schedule,
        sequence_parallel=bool(args.sequence_parallel), grad_checkpointing=checkpoint_mode(args.grad_checkpointing),
        use_compile=bool(args.use_compile), device=device, dtype=dtype, micro_batch=args.batch_size,
        num_microbatches=args.accumulation_steps,
        seq_len=args.max_seq_len, global_batch=args.batch_size * args.accumulation_steps * dp,
        # chunked loss: not under tp (vocab-sharded logits) nor pp (the schedule takes the last stage's logits)
        chunked_loss=args.loss_chunk_size > 0 and args.tp == 1 and args.pp == 1,
        doc_mask=bool(args.packing and args.doc_mask),
        save_dir=save_dir, checkpoint_dir=checkpoint_dir, metrics_file=metrics_file, tokenizer_path=tokenizer_path,
        tokenizer_record=tokenizer_record(tokenizer_path),
        cache_dir=cache_dir, seed=args.seed, data_path=data_path, eval_data_path=eval_data_path,
        from_weight=from_weight, tensorboard_dir=tensorboard_dir, trackers=trackers, log_dir=log_dir,
        profile_steps=profile_steps(args.profile_steps), weight_fields=weight_fields,
        model_config=config, run_name=name, weights_path=os.path.join(save_dir, name + ".pth"),
        run_dir=os.path.join(checkpoint_dir, name),
        save_dtype=getattr(torch, args.save_dtype), **resume_flags(args.from_resume),
        lr=resolve_schedule(args, args.batch_size * args.accumulation_steps * dp),
        optim=resolve_optimizer(args, has_dtensor=args.tp > 1 or dp_mode == "fsdp2"),
        callbacks=resolve_callbacks(args, has_eval=eval_data_path is not None),
        **copied_flags(args), flags=dict(vars(args)), dtype_note=dtype_note)
    return replace(plan, stage=resolve_stage(args, plan)) if resolve_stage is not None else plan


def weight_path(spec, save_dir, config):
    """A weights flag as a path: "none", a .pth or a folder as typed, else a weight prefix in save_dir,
    <save_dir>/<prefix>_<hidden>[_moe].pth, MiniMind's names (--from_weight, DPO's --ref_weight)."""
    if spec == "none":
        return "none"
    if spec.endswith(".pth") or os.path.isdir(spec):
        return typed_or_default(spec, None)
    return os.path.join(save_dir, weight_name(spec, config) + ".pth")


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


COPIED = ("learning_rate", "grad_clip", "epochs", "max_steps", "max_tokens", "log_interval", "save_interval",
          "save_weights_every", "save_every_minutes", "eval_interval", "eval_batches", "keep_checkpoints",
          "grace_seconds", "max_bad_steps", "check_replicas", "num_workers", "num_proc", "dist_timeout",
          "dist_init_timeout", "wandb_project", "powersgd_rank", "powersgd_start_step")
SWITCHES = ("async_save", "packing", "skip_bad_lines", "use_wandb", "tf32", "cpu_offload", "deterministic")


def copied_flags(args):
    """Flags the plan takes as they are (plus the 0/1 switches as bools)."""
    switches = {name: bool(getattr(args, name)) for name in SWITCHES}
    return dict({name: getattr(args, name) for name in COPIED}, **switches)


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
    """--profile_steps A:B as (A, B), or None; a bad spec is a ConfigError."""
    try:
        return parse_profile_steps(spec) if spec else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
