"""The checks resolve() runs, and the one on the built data (check_fills_a_step): each raises a ConfigError with
one line saying what to change."""
import math
import os
import tempfile

import torch

from dataset.mixture import resolve_data_spec
from model.errors import ConfigError
from model.weights.paths import other_sizes
from trainer.base.launch import per_rank
from trainer.observe import metrics  # read through the module: tests replace its CPU probes
from trainer.parallel.mesh import MODEL_DIMS, dimension_module, grad_reduce_factor, validate_layout

# bf16 is picked only this much faster than fp32 on the matmul: autocast also casts outside it (gradients, norms)
BF16_MARGIN = 1.1


def resolve_dtype(name, device):
    """(dtype, note): 'auto' -> the faster of bf16 and fp32 on this device (CPU: measured matmuls, cached per CPU
    model; CUDA: bf16 where supported) and a line saying why; bf16/fp16 rejected where unsupported."""
    dev = torch.device(device).type
    bf16_ok = torch.cuda.is_bf16_supported() if dev == "cuda" else metrics.cpu_bf16_native()
    if name == "auto":
        return auto_dtype(device, bf16_ok)
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise ConfigError(f"--dtype {name} is unknown; use auto, bfloat16, float16 or float32")
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(f"--dtype bfloat16 is not supported natively on this {dev} device; "
                          "use --dtype float32 (or auto)")
    if name == "float16" and dev == "cpu":
        raise ConfigError("--dtype float16 is not supported for training on CPU; use --dtype float32 (or auto)")
    return table[name], f"dtype {name}"


def auto_dtype(device, bf16_ok):
    """--dtype auto: (dtype, the reason in one line)."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        return (torch.bfloat16, f"dtype auto: bfloat16 (supported by {name})") if bf16_ok else \
            (torch.float32, f"dtype auto: float32 ({name} has no bf16)")
    if not bf16_ok:
        return torch.float32, f"dtype auto: float32 (no native bf16 matmul on {metrics.cpu_name()})"
    rates = metrics.cpu_matmul_rates()
    bf16, fp32 = rates["bfloat16_autocast"], rates["float32"]
    measured = f"bf16 matmul {bf16 / 1e9:.0f} GFLOP/s vs fp32 {fp32 / 1e9:.0f} on {metrics.cpu_name()}, " \
               f"{torch.get_num_threads()} threads"
    if rates["provisional"]:  # busy cores slow the two unequally: no decision from them; native bf16 is the likely win
        return torch.bfloat16, (f"dtype auto: bfloat16 (native bf16 on {metrics.cpu_name()}; the cores were busy, so "
                                f"the measurement, {measured}, decides nothing: a run on quiet cores measures again "
                                f"and caches it in {metrics.RATES_FILE})")
    dtype = torch.bfloat16 if bf16 > BF16_MARGIN * fp32 else torch.float32
    return dtype, f"dtype auto: {str(dtype)[6:]} ({measured}, measured on quiet cores; cached in {metrics.RATES_FILE})"


def check_same_dtype(dtype, device):
    """Under torchrun, every rank's --dtype auto chose the same dtype (ranks on different CPU kinds may not)."""
    chosen = per_rank(float(dtype == torch.bfloat16), device)
    if len(set(chosen)) > 1:
        raise ConfigError(f"--dtype auto chose bfloat16 on ranks {[r for r, c in enumerate(chosen) if c]} and float32 "
                          "on the others (their CPUs differ); pass --dtype float32 or --dtype bfloat16")


def data_parallel_mode(world_size, zero_stage=0, grad_compression="none", **sizes):
    """(dp, zero stage used, dp mode) of a layout; sizes: the model dimensions by name (tp=2, ep=2; missing ones are
    1); raises ConfigError naming what to change."""
    dp, message = validate_layout(world_size, **sizes)
    if message:
        raise ConfigError(message)
    tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
    replicas = grad_reduce_factor(dict(sizes, dp=dp))  # the gradient reducers
    if (tp > 1 or pp > 1) and replicas > 1 and zero_stage == 0 and grad_compression == "none":
        # DDP handles neither DTensor (tp) parameters nor a pipeline schedule's backward; FSDP2 does both
        zero_stage = 2
    if replicas > 1 or zero_stage != 0 or grad_compression != "none":  # the dp module's check, read when used
        message = dimension_module("dp").validate_data_parallel(zero_stage, grad_compression, dp=replicas, tp=tp,
                                                                pp=pp)
        if message:
            raise ConfigError(message)
    mode = "none" if replicas == 1 else {0: "ddp", 1: "zero1"}.get(zero_stage, "fsdp2")
    return dp, zero_stage, mode


def check_numbers(args, declared):
    """Every numeric flag in its range (`declared`: the Flags, trainer/base/schema.py, their `min` and `hint`): one
    line naming the flag, its value and what it takes."""
    for flag in declared:
        value = getattr(args, flag.name) if flag.min is not None else None
        if value is not None and value < flag.min:
            hint = f"; {flag.hint}" if flag.hint else ""
            raise ConfigError(f"--{flag.name} must be at least {flag.min} (got {value}{hint})")
    if args.seed >= 2 ** 32:
        raise ConfigError(f"--seed must be below 2**32 (got {args.seed})")
    for name in ("grad_clip", "grace_seconds"):  # inf is allowed only for --grad_clip (no clipping)
        value = getattr(args, name)
        if not value > 0 or (math.isinf(value) and name != "grad_clip"):
            raise ConfigError(f"--{name} must be a positive number (got {value})")
    for name in ("learning_rate", "weight_decay", "save_every_minutes"):  # lr 0 is meant: a run that only evaluates
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"--{name} must be a finite number, 0 or more (got {value})")
    if not 0 <= args.dropout < 1:
        raise ConfigError(f"--dropout must be in [0, 1) (got {args.dropout})")


def check_model_args(args, config):
    """Model and batch flags: one line saying what to change."""
    if args.head_dim is None and config.hidden_size % config.num_attention_heads:
        raise ConfigError(f"--hidden_size {config.hidden_size} is not divisible by --num_attention_heads "
                          f"{config.num_attention_heads}; pick sizes that divide or pass --head_dim")
    message = config.validate()
    if message:
        raise ConfigError(message)


def check_parallel_args(args, config, zero_stage):
    """Each dimension's own check (its module's validate, parallel/mesh.py DIMENSIONS), read only when the dimension
    is used; the sizes themselves are checked in data_parallel_mode."""
    for name in MODEL_DIMS:
        if getattr(args, name) > 1:
            message = dimension_module(name).validate(args, config, zero_stage)
            if message:
                raise ConfigError(message)


def check_combinations(args):
    """Features that do not compose (yet)."""
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence_parallel 1 needs --tp > 1")
    if args.sequence_parallel and args.pp > 1:
        raise ConfigError("--sequence_parallel 1 with --pp > 1 is not supported yet; drop one of them")
    if args.pp > 1 and args.use_compile:
        raise ConfigError("--use_compile 1 with --pp > 1 is not supported; drop one of them")


def check_replica_layout(check_replicas, dp_mode):
    if check_replicas and dp_mode == "fsdp2":
        raise ConfigError("--check_replicas compares replicated parameters, but FSDP2 (--zero_stage >= 2, or tp/pp "
                          "with data parallel) shards them; use --zero_stage 0 or 1, or --check_replicas 0")


def check_writable(directory, flag):
    """`directory` could be made and written: its nearest existing ancestor takes a file (no folder is created)."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {directory}: {existing} is a file, not a folder; choose another directory")
    try:  # os.access says yes to root everywhere; a probe file (gone at once) also catches /proc and read-only mounts
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ConfigError(f"{flag} {directory} is not writable ({e.strerror} in {existing}); choose another directory")


def check_paths(save_dir, from_weight, data_paths, others=()):
    """Output directories writable, input files present and non-empty; `others`: (directory, flag) to probe."""
    check_writable(save_dir, "--save_dir")
    for directory, flag in others:
        check_writable(directory, flag)
    if from_weight != "none" and not os.path.exists(from_weight):
        raise ConfigError(f"--from_weight: {from_weight} does not exist; {other_sizes(from_weight, '--from_weight')}"
                          "train it first (the stage before, with the same size flags) or pass --from_weight none")
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


def check_metrics_file(path):
    if os.path.isdir(path):
        raise ConfigError(f"--metrics_file {path} is a directory; pass a file path")
    check_writable(os.path.dirname(path) or ".", "--metrics_file folder")


def check_fills_a_step(samples, data_path, plan):
    """The built training data holds at least one global batch (run after the data, the one check resolve cannot
    make); else one line with the flags that fit one (small_batch)."""
    data, dp = plan.data, plan.layout.dp
    if samples < data.global_batch:
        factors = f"--batch_size {data.micro_batch} x --accumulation_steps {data.num_microbatches} x dp {dp}"
        raise ConfigError(f"{data_path} has {samples} samples, fewer than one global batch ({data.global_batch} "
                          f"= {factors}); {small_batch(samples, data.micro_batch, dp)}")


def small_batch(samples, micro_batch, dp):
    """The flags that fit a global batch to a small dataset: --accumulation_steps 1 and the largest power-of-two
    --batch_size (at most the typed one) that leaves an epoch of at least 4 steps (1 where the data is that small)."""
    if samples < dp:
        return f"run on at most {samples} data-parallel processes"
    fits = max(1, samples // (4 * dp))
    batch = min(micro_batch, 1 << (fits.bit_length() - 1))
    steps = samples // (batch * dp)
    return (f"pass --batch_size {batch} --accumulation_steps 1 ({steps} step{'s' if steps != 1 else ''} an epoch; "
            "--epochs for more)")
