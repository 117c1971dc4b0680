"""The training loop shared by train_pretrain.py and train_sft.py: flags, checks, step, log, checkpoint."""
import argparse
import contextlib
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from model.model_minimind import MiniMindConfig
from trainer.trainer_utils import (ConfigError, Logger, get_lr, init_distributed_mode, is_main_process, lm_checkpoint,
                                   peak_flops, repo_path, resolve_dtype, rng_state, step_flops,
                                   set_rng_state, setup_seed, SkipBatchSampler, weight_name, atomic_save)
from trainer.parallel import parallelize as parallel


def add_train_args(parser, **defaults):
    """MiniMind's flags (plus ours); `defaults` sets the script-specific values."""
    a = parser.add_argument
    a("--save_dir", default="out", help="where weights go (relative to the repo root)")
    a("--checkpoint_dir", default="checkpoints", help="where resume checkpoints go (relative to the repo root)")
    a("--save_weight", default="pretrain", help="weight file prefix: out/<save_weight>_<hidden>[_moe].pth")
    a("--epochs", type=int, default=1)
    a("--batch_size", type=int, default=32, help="samples per micro-batch per data-parallel rank")
    a("--learning_rate", type=float, default=5e-4)
    a("--warmup_steps", type=int, default=0)
    a("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    a("--dtype", default="auto", help="auto|bfloat16|float16|float32 (auto: bf16 where the device has it)")
    a("--num_workers", type=int, default=0)
    a("--accumulation_steps", type=int, default=8, help="micro-batches per optimizer step (pipeline: micro-batches)")
    a("--grad_clip", type=float, default=1.0)
    a("--weight_decay", type=float, default=0.01)
    a("--log_interval", type=int, default=100)
    a("--save_interval", type=int, default=100)
    a("--hidden_size", type=int, default=768)
    a("--num_hidden_layers", type=int, default=8)
    a("--num_attention_heads", type=int, default=8)
    a("--num_key_value_heads", type=int, default=4)
    a("--max_seq_len", type=int, default=340)
    a("--use_moe", type=int, default=0, choices=[0, 1])
    a("--num_experts", type=int, default=4)
    a("--num_experts_per_tok", type=int, default=1)
    a("--data_path", default=None, help="JSONL or parquet; default: the embedded demo corpus")
    a("--eval_data_path", default=None)
    a("--eval_interval", type=int, default=0, help="optimizer steps between validation runs (0: only at the end)")
    a("--eval_batches", type=int, default=50)
    a("--packing", type=int, default=0, choices=[0, 1], help="pretraining: join documents with eos into full rows (default 1 there)")
    a("--skip_bad_lines", type=int, default=0, choices=[0, 1])
    a("--tokenizer_path", default="model")
    a("--from_weight", default="none", help="weight prefix in save_dir, a .pth path, or none")
    a("--from_resume", type=int, default=0, choices=[0, 1])
    a("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: run all epochs)")
    a("--seed", type=int, default=42)
    a("--metrics_file", default=None, help="default out/<save_weight>_metrics.jsonl")
    a("--save_dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    a("--use_wandb", action="store_true")
    a("--wandb_project", default="MiniMind")
    a("--use_compile", type=int, default=0, choices=[0, 1], help="torch.compile each decoder block")
    a("--grad_checkpointing", type=int, default=0, choices=[0, 1],
      help="recompute each decoder block in backward (less activation memory, ~1/3 more compute)")
    a("--loss_chunk_size", type=int, default=1024,
      help="lm_head + cross-entropy over chunks of this many tokens, never the full logits (0: off)")
    a("--dist_timeout", type=int, default=60, help="seconds before a hung collective fails")
    parallel.add_parallel_args(parser)
    parser.set_defaults(**defaults)
    return parser


def build_config(args):
    return MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                          num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                          use_moe=bool(args.use_moe), num_experts=args.num_experts,
                          num_experts_per_tok=args.num_experts_per_tok, max_position_embeddings=max(32768, args.max_seq_len),
                          loss_chunk_size=args.loss_chunk_size)


def check_args(args, config):
    """Reject bad configuration with one line, before any collective or training work."""
    if args.max_seq_len < 2:
        raise ConfigError(f"--max_seq_len {args.max_seq_len} is too small; it must be at least 2")
    for name in ("batch_size", "accumulation_steps", "epochs", "log_interval", "save_interval"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden_size {args.hidden_size} is not divisible by --num_attention_heads "
                          f"{args.num_attention_heads}; pick sizes that divide")
    message = config.validate()
    if message:
        raise ConfigError(message)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device} but no CUDA device is available; use --device cpu")
    args.torch_dtype = resolve_dtype(args.dtype, args.device)
    save_dir = repo_path(args.save_dir)
    try:
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, f".write_test{os.getpid()}"), "w"):
            pass
        os.remove(os.path.join(save_dir, f".write_test{os.getpid()}"))
    except OSError as e:
        raise ConfigError(f"--save_dir {save_dir} is not writable ({e.strerror}); choose another directory")
    if args.from_weight != "none":
        path = args.from_weight if args.from_weight.endswith(".pth") else os.path.join(
            save_dir, weight_name(args.from_weight, config) + ".pth")
        if not os.path.isfile(repo_path(path)):
            raise ConfigError(f"--from_weight: {path} does not exist; train it first or pass --from_weight none")
    for path in (args.data_path, args.eval_data_path):
        if path is not None and not os.path.isfile(repo_path(path)):
            raise ConfigError(f"data file {repo_path(path)} does not exist; check --data_path/--eval_data_path")
        if path is not None and os.path.getsize(repo_path(path)) == 0:
            raise ConfigError(f"data file {repo_path(path)} is empty")
    parallel.check_parallel_args(args, config, int(os.environ.get("WORLD_SIZE", 1)))


def main_guard(main):
    """Run main(); a ConfigError becomes one line on stderr and exit code 2 on every rank."""
    try:
        main()
    except ConfigError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def setup(args):
    """Phase 1: checks, process group, device mesh, seed. Returns (config, run)."""
    config = build_config(args)
    check_args(args, config)
    local_rank = init_distributed_mode(args.dist_timeout)
    if dist.is_initialized() and args.device.startswith("cuda"):
        args.device = f"cuda:{local_rank}"
    run = parallel.setup_parallel(args, config)
    setup_seed(args.seed)  # same seed on every rank: every rank builds the same full model
    return config, run


def load_datasets(args, make_dataset):
    """Build train/eval datasets; dataset errors (bad lines, empty files) become ConfigErrors."""
    try:
        train_ds = make_dataset(repo_path(args.data_path))
        eval_ds = make_dataset(repo_path(args.eval_data_path)) if args.eval_data_path else None
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e))
    if len(train_ds) < global_batch(args):
        raise ConfigError(f"{args.data_path} has {len(train_ds)} samples, fewer than one global batch "
                          f"({global_batch(args)} = batch_size x accumulation_steps x dp); lower --batch_size")
    return train_ds, eval_ds


def global_batch(args):
    """Samples per optimizer step over all data-parallel ranks."""
    return args.batch_size * args.accumulation_steps * args.dp


def uses_chunked_loss(args):
    """Whether the loss runs chunked (lm_head on target tokens only, no full logits): not under tp, whose
    logits are vocab-sharded, nor with pp, whose schedule computes the loss from the last stage's logits."""
    return args.loss_chunk_size > 0 and args.tp == 1 and args.pp == 1


def step_targets(labels):
    """Targets aligned with inputs: labels shifted left by one, -100 appended (so sequences can be sharded)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def build_optimizer(args, run):
    params = [p for part in run.model_parts for p in part.parameters() if p.requires_grad]
    fused = args.device.startswith("cuda") and not run.has_dtensor
    return parallel.build_optimizer(params, args, run, fused)


def checkpoint_state(run, optimizer, scaler, epoch, step_in_epoch, global_step, tokens_seen, tracker_id, args):
    """Full (gathered, fp32) resume state; collective over all ranks, complete on rank 0 only."""
    model_sd, optim_sd = parallel.full_state(run, optimizer)
    if not is_main_process():
        return None
    return dict(model=model_sd, optimizer=optim_sd, scaler=scaler.state_dict(), epoch=epoch,
                step_in_epoch=step_in_epoch, global_step=global_step, tokens_seen=tokens_seen, rng=rng_state(),
                tracker_id=tracker_id,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                global_batch=global_batch(args), args=vars(args).copy())


def save_all(args, config, run, optimizer, scaler, epoch, step_in_epoch, global_step, tokens_seen, tracker_id):
    state = checkpoint_state(run, optimizer, scaler, epoch, step_in_epoch, global_step, tokens_seen, tracker_id, args)
    if state is not None:
        state["args"].pop("torch_dtype", None)
        save_dtype = getattr(torch, args.save_dtype)
        weights = {k: v.to(save_dtype) for k, v in state["model"].items()}
        atomic_save(weights, os.path.join(repo_path(args.save_dir), weight_name(args.save_weight, config) + ".pth"))
        lm_checkpoint(config, weight=args.save_weight, state=state, save_dir=args.checkpoint_dir)
    if dist.is_initialized():
        dist.barrier()


def peak_mem_gb(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def world_sum(values, device):
    """Sum a list of floats over all ranks (ranks that should not count pass zeros)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def evaluate(args, run, eval_ds):
    """Mean CE over target tokens of up to --eval_batches batches of held-out data; returns (loss, ppl)."""
    import math
    sampler = DistributedSampler(eval_ds, num_replicas=args.dp, rank=run.dp_rank, shuffle=False, drop_last=True)
    loader = DataLoader(eval_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    ce_sum = count = 0.0
    for part in run.model_parts:
        part.eval()
    with torch.no_grad():
        for i, (input_ids, labels) in enumerate(loader):
            if i >= args.eval_batches:
                break
            targets = step_targets(labels)
            n = float((targets != -100).sum())
            ce = forward_only(run, input_ids, targets)
            ce_sum += ce if run.counts_loss else 0.0
            count += n if run.counts_items else 0.0
    for part in run.model_parts:
        part.train()
    ce_sum, count = world_sum([ce_sum, count], run.device)
    loss = ce_sum / max(count, 1.0)
    return loss, math.exp(min(loss, 50))


def train(args, config, run, train_ds, eval_ds=None):
    """Phases 4-7: optimizer, resume, wrap, loop. One copy, used by pretraining and SFT."""
    device, dtype = run.device, args.torch_dtype
    ckpt = lm_checkpoint(config, weight=args.save_weight, save_dir=args.checkpoint_dir) if args.from_resume else None
    if ckpt is not None:
        if ckpt["global_batch"] != global_batch(args):
            raise ConfigError(f"checkpoint was saved with a global batch of {ckpt['global_batch']} samples, this run "
                              f"has {global_batch(args)} (batch_size x accumulation_steps x dp); match it to resume exactly")
    parallel.wrap_model(run, args, config, ckpt["model"] if ckpt else None)  # pp split -> tp -> cp -> ... -> dp
    optimizer = build_optimizer(args, run)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=(dtype == torch.float16))
    start_epoch = step_in_epoch = global_step = 0
    tracker_id = None
    if ckpt is not None:
        parallel.load_optimizer(run, optimizer, ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step_in_epoch, global_step = ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]
        tracker_id = ckpt.get("tracker_id")
        set_rng_state(ckpt["rng"])
        Logger(f"Resumed from epoch {start_epoch}, step {global_step} ({ckpt['world_size']} processes when saved)")
    tracker, tracker_id = start_tracker(args, tracker_id)

    autocast = torch.autocast(torch.device(device).type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    accum = args.accumulation_steps
    steps_per_epoch = len(train_ds) // args.dp // args.batch_size // accum
    total_steps = args.epochs * steps_per_epoch
    head_on_targets_only = uses_chunked_loss(args)
    peak = peak_flops(device, dtype) * (dist.get_world_size() if dist.is_initialized() else 1)
    metrics_path = repo_path(args.metrics_file or os.path.join(args.save_dir, f"{args.save_weight}_metrics.jsonl"))
    if is_main_process():
        os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
        if ckpt is None and os.path.exists(metrics_path):
            os.remove(metrics_path)  # a fresh run starts a fresh metrics file; a resumed one appends
    tokens_seen = ckpt["tokens_seen"] if ckpt else 0
    start_time = time.time()
    Logger(f"{steps_per_epoch} optimizer steps per epoch, global batch "
           f"{global_batch(args)} x {args.max_seq_len} tokens, dtype {dtype}")

    for epoch in range(start_epoch, args.epochs):
        if step_in_epoch >= steps_per_epoch:
            step_in_epoch = 0
            continue
        sampler = DistributedSampler(train_ds, num_replicas=args.dp, rank=run.dp_rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
        sampler.set_epoch(epoch)  # data order is a pure function of (seed, epoch)
        loader = DataLoader(train_ds, batch_sampler=SkipBatchSampler(sampler, args.batch_size, step_in_epoch * accum),
                            num_workers=args.num_workers, pin_memory=device.startswith("cuda"))
        batches = iter(loader)
        progress = make_progress(steps_per_epoch, step_in_epoch, epoch, args)
        window_start, window_tokens, window_flops = time.time(), 0, 0.0
        while step_in_epoch < steps_per_epoch:
            micro = [next(batches) for _ in range(accum)]
            lr = get_lr(global_step, total_steps, args.learning_rate, args.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            targets = [step_targets(labels) for _, labels in micro]
            local_items = sum(int((t != -100).sum()) for t in targets)
            num_items = dp_sum(run, local_items)  # the step's target tokens over all dp ranks
            ce, aux = forward_backward(run, [x for x, _ in micro], targets, num_items, args, autocast, scaler)
            scaler.unscale_(optimizer)
            clip_grad_norm_(run, args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            step_in_epoch += 1
            tokens_seen += num_items
            window_tokens += num_items
            positions = global_batch(args) * args.max_seq_len
            window_flops += step_flops(config, args.max_seq_len, positions, num_items, head_on_targets_only)
            progress.update(1)
            last = step_in_epoch == steps_per_epoch or global_step == args.max_steps
            if global_step % args.log_interval == 0 or last:
                ce_total, aux_total = world_sum([float(ce) if run.counts_loss else 0.0,
                                                 float(aux) if run.counts_loss else 0.0], device)
                elapsed = max(time.time() - window_start, 1e-9)
                mem_per_rank = per_rank(run, peak_mem_gb(device))
                mem = max(mem_per_rank)
                record = dict(step=global_step, epoch=epoch, loss=ce_total, aux_loss=aux_total, lr=lr, tokens=tokens_seen,
                              tokens_per_sec=window_tokens / elapsed,
                              mfu=window_flops / elapsed / peak, peak_mem_gb=mem,
                              peak_mem_gb_per_rank=[round(m, 4) for m in mem_per_rank],
                              elapsed_s=time.time() - start_time)
                window_start, window_tokens, window_flops = time.time(), 0, 0.0
                if is_main_process():
                    progress.write(f"Epoch:[{epoch + 1}/{args.epochs}]({step_in_epoch}/{steps_per_epoch}) "
                                   f"loss:{ce_total:.6f} aux_loss:{aux_total:.6f} lr:{lr:.3e} "
                                   f"tokens/s:{record['tokens_per_sec']:.0f} mfu:{record['mfu']:.1%} mem:{mem:.2f}GB")
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if tracker is not None:
                        tracker.log(record)
            if eval_ds is not None and args.eval_interval and global_step % args.eval_interval == 0:
                log_eval(args, run, eval_ds, global_step, metrics_path, tracker)
            if global_step % args.save_interval == 0 or last:
                save_all(args, config, run, optimizer, scaler, epoch, step_in_epoch, global_step, tokens_seen, tracker_id)
            if global_step == args.max_steps:
                break
        progress.close()
        if global_step == args.max_steps:
            break
        step_in_epoch = 0
    if eval_ds is not None and not (args.eval_interval and global_step % args.eval_interval == 0):
        log_eval(args, run, eval_ds, global_step, metrics_path, tracker)  # unless the last step just did
    Logger(f"Done: {global_step} steps, weights in {os.path.join(repo_path(args.save_dir), weight_name(args.save_weight, config))}.pth")
    if dist.is_initialized():
        dist.destroy_process_group()


def dp_sum(run, value):
    """Sum an int over data-parallel ranks (the step's global target-token count)."""
    if run.size("dp") == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=run.device)
    dist.all_reduce(t, group=run.group("dp"))
    return int(t.item())


def per_rank(run, value):
    """One float from every rank, in rank order (e.g. each rank's peak memory)."""
    if not dist.is_initialized():
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=run.device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return [g.item() for g in gathered]


def shard_for_context(run, tensors):
    """Context parallel: each rank keeps its head+tail chunks of the sequence, plus their positions."""
    if run.size("cp") == 1:
        return tensors, None
    from trainer.parallel.context import context_position_ids, shard_sequence
    cp, cp_rank = run.size("cp"), run.dims.cp_rank
    seq_len = tensors[0].shape[1]
    positions = context_position_ids(seq_len, cp_rank, cp, run.device)  # (1, L/cp)
    return [shard_sequence(t, cp_rank, cp, dim=1) for t in tensors], positions


def forward_backward(run, inputs, targets, num_items, args, autocast, scaler):
    """Forward and backward over the step's micro-batches; returns (ce, aux) partial sums as tensors.

    Each micro-batch adds ce_sum/num_items (num_items = the step's target tokens over all ranks) and
    aux_mean * samples/global_samples, so the sum over micro-batches and ranks is the step loss. The
    gradient is multiplied by dp*cp because DDP/FSDP average over those ranks.
    """
    from trainer.parallel.tensor import tp_loss_context
    from trainer.parallel.data import grad_reduce_factor
    aux_weight = args.batch_size / global_batch(args) / run.size("cp")  # every cp rank adds the (shared) aux
    grad_factor = grad_reduce_factor(run.size("dp"), run.size("cp"))
    if run.schedule is not None:
        return run.pipeline.step(run, inputs, targets, num_items, aux_weight, grad_factor, shard_for_context)
    model = run.model_parts[0]
    ce_total = aux_total = 0.0
    for i, (x, t) in enumerate(zip(inputs, targets)):
        (x, t), positions = shard_for_context(run, [x.to(run.device), t.to(run.device)])
        last = i == len(inputs) - 1
        sync = model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext()
        with sync, tp_loss_context(run.has_dtensor and run.size("tp") > 1):
            with autocast:
                out = model(x, position_ids=positions, shift_labels=t, num_items_in_batch=num_items)
            loss = out.loss + out.aux_loss * aux_weight
            scaler.scale(loss * grad_factor).backward()
        ce_total = ce_total + local_value(out.loss)
        aux_total = aux_total + local_value(out.aux_loss) * aux_weight
    return ce_total, aux_total


def local_value(t):
    """A detached plain tensor (DTensor losses under tensor parallel are replicated)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def forward_only(run, input_ids, targets):
    """Summed CE over the batch's targets on this rank (for validation; pp > 1 is refused up front)."""
    from trainer.parallel.tensor import tp_loss_context
    (x, t), positions = shard_for_context(run, [input_ids.to(run.device), targets.to(run.device)])
    with tp_loss_context(run.has_dtensor and run.size("tp") > 1):
        out = run.model_parts[0](x, position_ids=positions, shift_labels=t, num_items_in_batch=1)
    return float(local_value(out.loss))


def clip_grad_norm_(run, max_norm):
    from trainer.parallel.utils import clip_grad_norm_ as clip
    if run.pipeline is not None:
        run.pipeline.sync_tied_grads()
    params = [p for part in run.model_parts for p in part.parameters() if p.grad is not None]
    pp_group = run.group("pp") if run.size("pp") > 1 else None
    exclude = run.pipeline.duplicate_params() if run.pipeline is not None else None
    return clip(params, max_norm, pp_group=pp_group, exclude=exclude)


def log_eval(args, run, eval_ds, global_step, metrics_path, tracker):
    loss, ppl = evaluate(args, run, eval_ds)
    if is_main_process():
        Logger(f"step {global_step}: eval_loss {loss:.4f} ppl {ppl:.2f}")
        with open(metrics_path, "a") as f:
            f.write(json.dumps(dict(step=global_step, eval_loss=loss, eval_ppl=ppl)) + "\n")
        if tracker is not None:
            tracker.log(dict(eval_loss=loss, eval_ppl=ppl))


def make_progress(total, done, epoch, args):
    from tqdm import tqdm
    return tqdm(total=total, initial=done, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not is_main_process(),
                dynamic_ncols=True, mininterval=1.0)


def start_tracker(args, tracker_id):
    """swanlab (wandb-compatible), offline when not logged in; a run never needs it."""
    if not args.use_wandb or not is_main_process():
        return None, tracker_id
    try:
        import swanlab
    except ImportError:
        Logger("--use_wandb: swanlab is not installed (pip install swanlab); continuing without tracking")
        return None, tracker_id
    run = swanlab.init(project=args.wandb_project, config={k: str(v) for k, v in vars(args).items()},
                       id=tracker_id, resume="allow" if tracker_id else None, mode="local" if tracker_id is None else None)
    return swanlab, getattr(run, "id", tracker_id)


def parse_args(description, **defaults):
    parser = argparse.ArgumentParser(description=description)
    add_train_args(parser, **defaults)
    return parser.parse_args()
