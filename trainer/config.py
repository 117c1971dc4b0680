"""Flags, the model config they describe, and the one resolved, frozen TrainPlan every script reads.

`args` stays what the user typed (it is saved in checkpoints as such); everything derived from it
(layout, data-parallel mode, dtype, device, batch shape, resolved paths) is computed once in
`resolve(args, world_size)`, which also rejects bad input with a ConfigError before any collective.
"""
import argparse
import atexit
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from model.model_minimind import MiniMindConfig
from dataset.mixture import absolute_data_spec, resolve_data_spec
from model.weights import WeightsError, flag_conflicts, infer_config, read_weights
from trainer.parallel.data import validate_data_parallel
from trainer.parallel.mesh import validate_layout
from trainer.parallel.pipeline import pp_validate
from trainer.parallel.tensor import tp_validate
from trainer.guard import TrainingHalted
from trainer.tracking import parse_profile_steps
from trainer.trainer_utils import ConfigError, Logger, typed_or_default, weight_name


def add_train_args(parser, **defaults):
    """MiniMind's flags (plus ours); `defaults` sets the script-specific values."""
    a = parser.add_argument
    a("--save_dir", default=None, help="where weights and metrics go (default: out/ in the repo)")
    a("--checkpoint_dir", default=None, help="where resume checkpoints go (default: checkpoints/ in the repo)")
    a("--save_weight", default="pretrain", help="weight file prefix: <save_dir>/<save_weight>_<hidden>[_moe].pth")
    a("--epochs", type=int, default=1, help="passes over the training data")
    a("--batch_size", type=int, default=32, help="samples per micro-batch per data-parallel rank")
    a("--learning_rate", type=float, default=5e-4, help="peak learning rate of MiniMind's cosine schedule")
    a("--warmup_steps", type=int, default=0, help="linear warm-up steps before the cosine schedule")
    a("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    a("--dtype", default="auto", help="auto|bfloat16|float16|float32 (auto: bf16 where the device has it)")
    a("--num_workers", type=int, default=0, help="DataLoader worker processes")
    a("--accumulation_steps", type=int, default=8, help="micro-batches per optimizer step (pipeline: micro-batches)")
    a("--grad_clip", type=float, default=1.0, help="clip the global gradient norm to this value")
    a("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    a("--log_interval", type=int, default=100, help="optimizer steps between metrics records")
    a("--save_interval", type=int, default=100, help="optimizer steps between weights + resume checkpoints")
    a("--hidden_size", type=int, default=768, help="model width")
    a("--num_hidden_layers", type=int, default=8, help="decoder blocks")
    a("--num_attention_heads", type=int, default=8, help="query heads")
    a("--num_key_value_heads", type=int, default=4, help="key/value heads (GQA)")
    a("--intermediate_size", type=int, default=None, help="dense MLP width (default: the model's rule)")
    a("--moe_intermediate_size", type=int, default=None, help="expert MLP width (default: the model's rule)")
    a("--head_dim", type=int, default=None, help="attention head size (default: hidden_size / heads)")
    a("--max_seq_len", type=int, default=340, help="tokens per sample")
    a("--use_moe", type=int, default=0, choices=[0, 1], help="mixture-of-experts MLPs")
    a("--num_experts", type=int, default=4, help="experts per MoE layer")
    a("--num_experts_per_tok", type=int, default=1, help="experts each token is routed to")
    a("--data_path", default=None, help="JSONL, parquet or token shard; a directory, a glob, or a comma list with "
      "optional weights, e.g. a.jsonl:0.7,shards/*.parquet:0.3 (default: the embedded demo corpus)")
    a("--eval_data_path", default=None, help="held-out data for eval_loss / eval_ppl, same forms (default: none)")
    a("--num_proc", type=int, default=None, help="tokenizer worker processes per rank while building the token "
      "cache (default: the cores available / local ranks)")
    a("--eval_interval", type=int, default=0, help="optimizer steps between validation runs (0: only at the end)")
    a("--eval_batches", type=int, default=50, help="batches per validation run")
    a("--packing", type=int, default=0, choices=[0, 1], help="pretraining: join documents with eos into full rows")
    a("--doc_mask", type=int, default=1, choices=[0, 1], help="with --packing 1: a token attends only to earlier "
      "tokens of its own document and position ids restart at each document (0: the whole row is one sequence)")
    a("--skip_bad_lines", type=int, default=0, choices=[0, 1], help="skip malformed data lines instead of stopping")
    a("--cache_dir", default=None, help="token cache of the datasets (default: dataset/.cache in the repo)")
    a("--tokenizer_path", default=None, help="Hugging Face tokenizer folder (default: model/ in the repo)")
    a("--from_weight", default="none", help="weight prefix in save_dir, a .pth path, or none")
    a("--from_resume", default="0", choices=["0", "1", "auto"],
      help="1: continue from the newest complete checkpoint; auto: that, or start fresh if there is none (for torchrun --max-restarts)")
    a("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: run all epochs)")
    a("--seed", type=int, default=42, help="model init and data order (a pure function of seed and epoch)")
    a("--metrics_file", default=None, help="JSONL records (default: <save_dir>/<save_weight>_<hidden>[_moe]_metrics.jsonl)")
    a("--save_dtype", default="float16", choices=["float16", "bfloat16", "float32"], help="dtype of the saved weights")
    a("--use_compile", type=int, default=0, choices=[0, 1], help="torch.compile each decoder block")
    a("--grad_checkpointing", type=int, default=0, choices=[0, 1],
      help="recompute each decoder block in backward (less activation memory, ~1/3 more compute)")
    a("--loss_chunk_size", type=int, default=1024,
      help="lm_head + cross-entropy over chunks of this many tokens, never the full logits (0: off)")
    add_tracking_args(parser)
    add_checkpoint_args(parser)
    add_guard_args(parser)
    add_parallel_args(parser)
    parser.set_defaults(**defaults)
    return parser


def add_tracking_args(parser):
    """Where metrics and traces go besides the metrics file (trainer/tracking.py)."""
    a = parser.add_argument
    a("--tensorboard_dir", default=None, help="also write TensorBoard scalars here (default: off)")
    a("--profile_steps", default=None, help="A:B: torch.profiler trace of optimizer steps A to B under <save_dir>/profile (default: off)")
    a("--use_wandb", action="store_true", help="log to swanlab (local mode when not logged in)")
    a("--wandb_project", default="MiniMind", help="swanlab project name")


def add_checkpoint_args(parser):
    """How resume checkpoints and weights are written (trainer/checkpoint.py)."""
    a = parser.add_argument
    a("--keep_checkpoints", type=int, default=3, help="complete resume checkpoints kept; older ones are deleted (0: all)")
    a("--async_save", type=int, default=0, choices=[0, 1], help="write resume checkpoints in the background (dcp.async_save)")
    a("--save_weights_every", type=int, default=0,
      help="also write the <save_weight>.pth weights every N steps (0: at the end only)")


def add_guard_args(parser):
    """Preemption, the non-finite step guard and the replica check (trainer/guard.py)."""
    a = parser.add_argument
    a("--grace_seconds", type=float, default=60,
      help="after SIGTERM/SIGINT: seconds to finish the step and save before exiting non-zero")
    a("--max_bad_steps", type=int, default=5, help="stop after this many non-finite (skipped) optimizer steps in a row")
    a("--check_replicas", type=int, default=0,
      help="every N steps compare parameter checksums across data-parallel replicas (0: off)")


def add_parallel_args(parser):
    """The layout flags (4D parallelism, ZeRO, collectives)."""
    a = parser.add_argument
    a("--dist_timeout", type=int, default=60, help="seconds before a hung collective fails")
    a("--tp", type=int, default=1, help="tensor-parallel degree")
    a("--pp", type=int, default=1, help="pipeline-parallel degree (micro-batches = --accumulation_steps)")
    a("--cp", type=int, default=1, help="context-parallel (ring attention) degree")
    a("--pp_schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved1f1b"], help="pipeline schedule")
    a("--sequence_parallel", type=int, default=0, choices=[0, 1], help="shard norms along the sequence (tp > 1)")
    a("--zero_stage", type=int, default=0, help="0: DDP, 1: sharded optimizer, 2: +gradients, 3: +parameters (FSDP2)")
    a("--grad_compression", default="none", help="none|bf16|powersgd (DDP communication hook)")


def parse_args(description, **defaults):
    """The script's flags; --help shows every default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_train_args(parser, **defaults).parse_args()


MODEL_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "moe_intermediate_size", "head_dim", "use_moe", "num_experts", "num_experts_per_tok")


def build_config(args, weight_fields=None):
    """The MiniMindConfig the flags describe (None sizes keep the model's own rule); `weight_fields`, the shapes
    of the --from_weight file (see weight_shapes), take precedence over the flags."""
    fields = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name, None) is not None}
    fields["use_moe"] = bool(fields["use_moe"])
    fields.update(weight_fields or {})
    return MiniMindConfig(max_position_embeddings=max(32768, args.max_seq_len), loss_chunk_size=args.loss_chunk_size,
                          **fields)


def weight_shapes(args, path):
    """The model fields a --from_weight file fixes (from its tensors, and top-k from its saved config); one line
    says which flags they override, so a MiniMind-3 .pth or an older run's weights load without size flags."""
    try:
        state_dict, saved_config = read_weights(path)
        fields = infer_config(state_dict)
    except WeightsError as e:
        raise ConfigError(str(e)) from None
    if saved_config and "num_experts_per_tok" in saved_config and fields["use_moe"]:
        fields["num_experts_per_tok"] = saved_config["num_experts_per_tok"]
    flags = {name: getattr(args, name) for name in MODEL_FLAGS if name != "use_moe"}
    conflicts = flag_conflicts(fields, dict(flags, use_moe=bool(args.use_moe)))
    if conflicts:
        Logger(f"--from_weight {path}: the model takes the weights' shapes, not the flags: {'; '.join(conflicts)}")
    return fields


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
    grad_checkpointing: bool
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
    cache_dir: str
    seed: int  # model init and data order
    data_path: Optional[str]  # a spec for dataset.mixture.resolve_data_spec; None: the embedded demo corpus
    eval_data_path: Optional[str]
    from_weight: str  # "none" or a .pth path
    tensorboard_dir: Optional[str]
    profile_steps: Optional[tuple]
    weight_fields: dict  # model fields fixed by the --from_weight file (build_config(args, weight_fields))

    @property
    def micro_batch_shape(self):
        """(samples, tokens) of one micro-batch on one rank (tokens after context parallel's split)."""
        return self.micro_batch, self.seq_len // self.cp

    @property
    def has_dtensor(self):
        """Parameters are DTensors (tensor parallel or FSDP2): no fused AdamW, losses may be DTensors."""
        return self.tp > 1 or self.dp_mode == "fsdp2"

    @property
    def autocast_dtype(self):
        return None if self.dtype == torch.float32 else self.dtype


def resolve_dtype(name, device):
    """'auto' -> bf16 where the device supports it, else fp32; reject bf16/fp16 where unsupported."""
    dev = torch.device(device).type
    bf16_ok = torch.cuda.is_bf16_supported() if dev == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if name == "auto":
        return torch.bfloat16 if bf16_ok else torch.float32
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise ConfigError(f"--dtype {name} is unknown; use auto, bfloat16, float16 or float32")
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(f"--dtype bfloat16 is not supported natively on this {dev} device; use --dtype float32 (or auto)")
    if name == "float16" and dev == "cpu":
        raise ConfigError("--dtype float16 is not supported for training on CPU; use --dtype float32 (or auto)")
    return table[name]


def data_parallel_mode(world_size, tp=1, pp=1, cp=1, zero_stage=0, grad_compression="none"):
    """(dp, zero stage used, dp mode) of a layout; raises ConfigError naming what to change."""
    dp, message = validate_layout(world_size, tp=tp, pp=pp, cp=cp)
    if message:
        raise ConfigError(message)
    if (tp > 1 or pp > 1) and dp * cp > 1 and zero_stage == 0 and grad_compression == "none":
        # DDP handles neither DTensor (tp) parameters nor a pipeline schedule's backward; FSDP2 does both
        zero_stage = 2
    message = validate_data_parallel(zero_stage, grad_compression, dp=dp * cp, tp=tp, pp=pp)
    if message:
        raise ConfigError(message)
    mode = "none" if dp * cp == 1 else {0: "ddp", 1: "zero1"}.get(zero_stage, "fsdp2")
    return dp, zero_stage, mode


# the smallest value each integer flag takes (None: the flag's "use the default rule" value, always allowed)
AT_LEAST = dict(max_seq_len=2, batch_size=1, accumulation_steps=1, epochs=1, log_interval=1, save_interval=1,
                hidden_size=1, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, intermediate_size=1,
                moe_intermediate_size=1, head_dim=1, num_experts=1, num_experts_per_tok=1, eval_batches=1,
                max_bad_steps=1, dist_timeout=1, warmup_steps=0, num_workers=0, eval_interval=0, max_steps=0,
                loss_chunk_size=0, check_replicas=0, seed=0, keep_checkpoints=0, save_weights_every=0, num_proc=1)
HINTS = dict(max_steps="0 runs all epochs", keep_checkpoints="0 keeps all", save_weights_every="0 saves at the end only",
             num_proc="leave it unset for the cores available", eval_interval="0 evaluates at the end only", check_replicas="0 is off",
             loss_chunk_size="0 is off", seed="numpy takes 0 to 2**32-1")


def check_numbers(args):
    """Every numeric flag in its range: one line naming the flag, its value and what it takes."""
    for name, low in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < low:
            hint = f"; {HINTS[name]}" if name in HINTS else ""
            raise ConfigError(f"--{name} must be at least {low} (got {value}{hint})")
    if args.seed >= 2 ** 32:
        raise ConfigError(f"--seed must be below 2**32 (got {args.seed})")
    for name in ("grad_clip", "grace_seconds"):  # inf is allowed only for --grad_clip (no clipping)
        value = getattr(args, name)
        if not value > 0 or (math.isinf(value) and name != "grad_clip"):
            raise ConfigError(f"--{name} must be a positive number (got {value})")
    for name in ("learning_rate", "weight_decay"):  # lr 0 is meant: a run that only evaluates or re-saves weights
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"--{name} must be a finite number, 0 or more (got {value})")


def check_device(device):
    """--device names a cpu or cuda device (available)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device} is not a device this trainer runs on; use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} but no CUDA device is available; use --device cpu")


def check_model_args(args, config):
    """Model and batch flags: one line saying what to change."""
    if args.head_dim is None and config.hidden_size % config.num_attention_heads:
        raise ConfigError(f"--hidden_size {config.hidden_size} is not divisible by --num_attention_heads "
                          f"{config.num_attention_heads}; pick sizes that divide or pass --head_dim")
    message = config.validate()
    if message:
        raise ConfigError(message)


def check_parallel_args(args, config):
    """Per-dimension layout checks (the sizes themselves are checked in data_parallel_mode)."""
    if args.tp > 1:
        message = tp_validate(config, args.tp, seq_len=args.max_seq_len // args.cp if args.sequence_parallel else None)
        if message:
            raise ConfigError(message)
    if args.cp > 1 and args.max_seq_len % (2 * args.cp):
        raise ConfigError(f"--max_seq_len {args.max_seq_len} must be divisible by 2*cp = {2 * args.cp} "
                          "(each rank holds a head and a tail chunk); change --max_seq_len or --cp")
    if args.pp > 1:
        message = pp_validate(config.num_hidden_layers, args.pp, args.pp_schedule, args.accumulation_steps)
        if message:
            raise ConfigError(message)


def check_combinations(args):
    """Features that do not compose (yet)."""
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence_parallel 1 needs --tp > 1")
    if args.sequence_parallel and args.pp > 1:
        raise ConfigError("--sequence_parallel 1 with --pp > 1 is not supported yet; drop one of them")
    if args.pp > 1 and args.eval_data_path:
        raise ConfigError("--eval_data_path with --pp > 1 is not supported yet; validate with a pp=1 run")
    if args.pp > 1 and args.use_compile:
        raise ConfigError("--use_compile 1 with --pp > 1 is not supported; drop one of them")


def check_replica_layout(check_replicas, dp_mode):
    if check_replicas and dp_mode == "fsdp2":
        raise ConfigError("--check_replicas compares replicated parameters, but FSDP2 (--zero_stage >= 2, or tp/pp "
                          "with data parallel) shards them; use --zero_stage 0 or 1, or --check_replicas 0")


def check_writable(directory, flag):
    """`directory` exists or can be made, and takes a file."""
    probe = os.path.join(directory, f".write_test{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {directory} is not writable ({e.strerror}); choose another directory")


def check_paths(save_dir, from_weight, data_paths, others=()):
    """Output directories writable, input files present and non-empty; `others`: (directory, flag) to probe."""
    check_writable(save_dir, "--save_dir")
    for directory, flag in others:
        check_writable(directory, flag)
    if from_weight != "none" and not os.path.exists(from_weight):
        raise ConfigError(f"--from_weight: {from_weight} does not exist; train it first or pass --from_weight none")
    for flag, spec in data_paths:
        if spec is None:
            continue
        try:
            files = [f for group, _ in resolve_data_spec(spec) for f in group]
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"{flag}: {e}") from None
        for path in files:
            if os.path.getsize(path) == 0:
                raise ConfigError(f"data file {path} is empty; check {flag}")


def check_tokenizer(path):
    """A Hugging Face tokenizer folder: a directory with tokenizer.json or tokenizer_config.json."""
    if not os.path.isdir(path):
        raise ConfigError(f"--tokenizer_path {path} is not a directory; pass the folder with tokenizer.json "
                          "(default: model/ in the repo)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"--tokenizer_path {path} has no tokenizer.json or tokenizer_config.json; "
                          "pass a Hugging Face tokenizer folder")


def check_metrics_file(path):
    if os.path.isdir(path):
        raise ConfigError(f"--metrics_file {path} is a directory; pass a file path")
    check_writable(os.path.dirname(path) or ".", "--metrics_file folder")


def resolve(args, world_size, local_rank=0):
    """Check the flags and derive the frozen TrainPlan; raises ConfigError before any collective."""
    check_numbers(args)
    check_device(args.device)
    save_dir = typed_or_default(args.save_dir, "out")
    from_weight = args.from_weight
    if from_weight != "none":  # a path, or a weight prefix: <save_dir>/<prefix>_<hidden>[_moe].pth
        from_weight = typed_or_default(from_weight, None) if from_weight.endswith(".pth") or os.path.isdir(
            from_weight) else os.path.join(save_dir, weight_name(from_weight, build_config(args)) + ".pth")
    data_path, eval_data_path = (absolute_data_spec(spec) if spec else None for spec in (args.data_path, args.eval_data_path))
    checkpoint_dir = typed_or_default(args.checkpoint_dir, "checkpoints")
    cache_dir = typed_or_default(args.cache_dir, os.path.join("dataset", ".cache"))
    tensorboard_dir = typed_or_default(args.tensorboard_dir, None)
    outputs = [(checkpoint_dir, "--checkpoint_dir"), (cache_dir, "--cache_dir")]
    check_paths(save_dir, from_weight, (("--data_path", data_path), ("--eval_data_path", eval_data_path)),
                outputs + ([(tensorboard_dir, "--tensorboard_dir")] if tensorboard_dir else []))
    tokenizer_path = typed_or_default(args.tokenizer_path, "model")
    check_tokenizer(tokenizer_path)
    weight_fields = weight_shapes(args, from_weight) if from_weight != "none" else {}
    config = build_config(args, weight_fields)
    check_model_args(args, config)
    dtype = resolve_dtype(args.dtype, args.device)
    dp, zero_stage, dp_mode = data_parallel_mode(world_size, args.tp, args.pp, args.cp, args.zero_stage,
                                                 args.grad_compression)
    check_parallel_args(args, config)
    check_combinations(args)
    check_replica_layout(args.check_replicas, dp_mode)
    if zero_stage != args.zero_stage:
        Logger(f"tp/pp with dp*cp > 1: data parallel uses FSDP2 with gathered parameters (zero stage {zero_stage})")
    name = weight_name(args.save_weight, config)
    metrics_file = typed_or_default(args.metrics_file, None) or os.path.join(save_dir, f"{name}_metrics.jsonl")
    check_metrics_file(metrics_file)
    device = f"cuda:{local_rank}" if world_size > 1 and args.device.startswith("cuda") else args.device
    return TrainPlan(
        world_size=world_size, dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, zero_stage=zero_stage, dp_mode=dp_mode,
        grad_compression=args.grad_compression, pp_schedule=args.pp_schedule,
        sequence_parallel=bool(args.sequence_parallel), grad_checkpointing=bool(args.grad_checkpointing),
        use_compile=bool(args.use_compile), device=device, dtype=dtype, micro_batch=args.batch_size, num_microbatches=args.accumulation_steps,
        seq_len=args.max_seq_len, global_batch=args.batch_size * args.accumulation_steps * dp,
        # chunked loss: not under tp (vocab-sharded logits) nor pp (the schedule takes the last stage's logits)
        chunked_loss=args.loss_chunk_size > 0 and args.tp == 1 and args.pp == 1,
        doc_mask=bool(args.packing and args.doc_mask),
        save_dir=save_dir, checkpoint_dir=checkpoint_dir, metrics_file=metrics_file, tokenizer_path=tokenizer_path,
        cache_dir=cache_dir, seed=args.seed, data_path=data_path, eval_data_path=eval_data_path,
        from_weight=from_weight, tensorboard_dir=tensorboard_dir,
        profile_steps=profile_steps(args.profile_steps), weight_fields=weight_fields)


def profile_steps(spec):
    """--profile_steps A:B as (A, B), or None; a bad spec is a ConfigError."""
    try:
        return parse_profile_steps(spec) if spec else None
    except ValueError as e:
        raise ConfigError(str(e)) from None


RANK0_REPORT_SECONDS = 2


def main_guard(main):
    """Run main(); a ConfigError becomes one line on stderr and exit code 2 on every rank, a TrainingHalted (the run
    stopped itself: non-finite steps, diverged replicas) one line and exit code 3."""
    code = 0
    try:
        main()
    except (ConfigError, TrainingHalted) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif not dist.is_initialized():
            # torchrun stops every worker as soon as one exits: let rank 0, which ran the same checks, say it first
            time.sleep(RANK0_REPORT_SECONDS)
        if dist.is_initialized():
            dist.destroy_process_group()
        code = 2 if isinstance(e, ConfigError) else 3
    if int(os.environ.get("RANK", -1)) != -1:  # a torchrun worker
        leave_without_finalizing(code)
    sys.exit(code)


def leave_without_finalizing(code):
    """Exit a torchrun worker once its work is done, skipping the interpreter's finalization.

    A gloo worker thread (pt_gloo_runloop) frees each finished collective's work object, and with it the last
    reference to tensors whose Python objects need the GIL. Its process group outlives destroy_process_group (DTensor
    and FSDP objects hold it), so when that free lands after Python has begun finalizing, the thread cannot take the GIL
    and the process aborts ("terminate called without an active exception", SIGABRT; gdb: THPVariable_clear <-
    ~AsyncAllgatherCoalescedWork <- ProcessGroupGloo::runLoop while the main thread is in Py_FinalizeEx): 3 of 69 2-rank
    ZeRO-3 runs here, exit code -6 although training had finished. Everything is written and closed by now, so run the
    atexit handlers, flush, and leave with the exit code the run earned.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
