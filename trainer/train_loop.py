"""The training loop every stage runs: `build_trainer` (phases 3-6), `train()` (the loop), `train_step()` (one
optimizer step).

Read `train()` for the loop and `train_step()` for one optimizer step. Flags and checks live in config.py, data in
data_loading.py, a batch's way into the model in batches.py, checkpoints in checkpoint.py, the console and records in
progress.py, evaluation in evaluation.py, the callbacks in callbacks.py, the parallel dimensions in parallel/
(applied by parallel/parallelize.py).
"""
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.batches import autocast, shard_for_context, step_targets, to_device
from trainer.callbacks import make_callbacks
from trainer.checkpoint import Checkpointer, TrainState, read_resume, rng_state, set_rng_state, tied_aliases
from trainer.checks import check_same_dtype
from trainer.config import resolve
from trainer.config_file import write_run_config
from trainer.data_loading import epoch_loader, leaf_datasets, load_chat_datasets, load_datasets  # noqa: F401 (stages)
from trainer.evaluation import evaluate
from trainer.guard import (
    Preemption,
    StepAbandoned,
    StepGuard,
    add_signal_points,
    check_replicas,
    scaler_found_inf,
)
from trainer.launch import (
    count_sum,
    init_distributed_mode,
    is_main_process,
    local_value,
    rank,
    set_collective_timeout,
    setup_seed,
)
from trainer.metrics import StepTimer, enable_tf32, peak_flops, trim_heap
from trainer.objective import LMObjective, add_stats, target_tokens
from trainer.oom import out_of_memory_as_one_line
from trainer.optim import build_optimizer
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.data import grad_reduce_factor, gradient_sync
from trainer.parallel.mesh import ParallelDims
from trainer.parallel.parallelize import parallelize
from trainer.parallel.tensor import tp_loss_context
from trainer.progress import NO_BAR, Bar, effective_log_interval, make_tracker, messages_above_bar, step_record
from trainer.rank_log import open_rank_log
from trainer.schedule import lr_at, resume_note
from trainer.storage import checkpoint_bytes_estimate, room_warning
from trainer.tracking import StepProfiler
from trainer.trainer_utils import Logger
from trainer.weights_file import ensure_final_weights, init_model, save_weights, weights_path


@dataclass
class Trainer:
    """What a step needs: the plan, where this rank sits, what it trains, and where training stands."""
    plan: object  # config.TrainPlan
    config: object  # MiniMindConfig
    dims: ParallelDims
    model_parts: list  # this rank's pipeline stages, or [model]
    pipeline: object  # parallel.pipeline.Pipeline when pp > 1, else None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    progress: TrainState
    steps_per_epoch: int
    total_steps: int  # of the lr schedule (all epochs, or --max_steps)
    checkpointer: Checkpointer
    guard: StepGuard  # non-finite skips and the agreed preemption stop
    objective: object = None  # what train_step minimises (trainer/objective.py); build_trainer sets LMObjective
    callbacks: object = None  # callbacks.Callbacks: sinks, early stopping, best checkpoint, a user's
    resumed: bool = False
    started: bool = False  # the first step is done: collectives run under the per-step timeout
    step_rng: dict = None  # RNG states as the step in progress began (one process: a dropped step saves them)


def setup(args, resolve_stage=None):
    """Phase 1: check the flags into a TrainPlan, start the process group and mesh, seed. Returns (plan, dims).

    resolve_stage: a post-training stage's resolver (see config.resolve)."""
    plan = resolve(args, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)), resolve_stage)
    if plan.deterministic:  # read by cuBLAS when CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_distributed_mode(plan.device, plan.dist_init_timeout)
    open_rank_log(plan.log_dir, f"{plan.run_name}, rank {rank()} of {plan.world_size}")
    enable_tf32(plan.device, strict=not plan.tf32)  # before peak_flops reads the matmul precision
    dims = ParallelDims.build(plan.world_size, tp=plan.tp, pp=plan.pp, cp=plan.cp,
                              device_type=torch.device(plan.device).type)
    Logger(dims.summary())
    if plan.flags.get("dtype") == "auto":
        check_same_dtype(plan.dtype, plan.device)  # each rank measured (or read) the rates itself
        Logger(plan.dtype_note)
    setup_seed(plan.seed, plan.deterministic)  # same seed on every rank: every rank builds the same full model
    return plan, dims


def build_model(config, plan, model_state=None):
    """The plain full model on plan.device: --from_weight (or resume) weights, else the seeded init."""
    model = init_model(config, plan.from_weight)
    if model_state is not None:
        model.load_state_dict(model_state)
    return model.to(plan.device)


def build_trainer(plan, dims, steps_per_epoch, objective=None):
    """Phases 3-6: resume state, model, parallel wrap, optimizer, restore; the Trainer can run train_step at once.

    objective: what the stage minimises (trainer/objective.py); None: LMObjective (pretraining, SFT)."""
    config = plan.model_config
    ckpt = read_resume(config, plan)
    model = build_model(config, plan, ckpt.get("model") if ckpt else None)  # a DCP checkpoint loads in restore
    if hasattr(plan.stage, "prepare_model"):  # e.g. LoRA: adapters on the plain loaded model, base frozen
        model = plan.stage.prepare_model(model)
    estimate = checkpoint_bytes_estimate(model, plan.save_dtype.itemsize)
    warning = room_warning(plan.checkpoint_dir, estimate)
    if warning:
        Logger(warning)
    model_parts, pipeline = parallelize(model, dims, plan)  # pp split -> tp -> cp -> ... -> dp
    if plan.world_size == 1 and not plan.use_compile:  # a signal then drops a step between blocks of its backward
        add_signal_points(model_parts)
    optimizer = build_optimizer(model_parts, plan, dims)  # --optimizer (trainer/optim.py), ZeRO-1 sharded or not
    scaler = torch.amp.GradScaler(torch.device(plan.device).type, enabled=plan.dtype == torch.float16)
    progress, objective, callbacks = TrainState(), objective or LMObjective(), make_callbacks(plan)
    checkpointer = Checkpointer(plan.run_dir, plan.async_save, plan.keep_checkpoints, parts=dict(
        model_parts=model_parts, optimizer=optimizer, scaler=scaler, progress=progress, objective=objective,
        tied=tied_aliases(pipeline, config), plan=plan, config=config, callbacks=callbacks), estimate=estimate)
    guard = StepGuard(plan.max_bad_steps, Preemption(plan.grace_seconds, abandon=plan.world_size == 1),
                      plan.save_every_minutes * 60)
    trainer = Trainer(plan, config, dims, model_parts, pipeline, optimizer, scaler, progress, steps_per_epoch,
                      plan.lr.length(steps_per_epoch, plan.epochs), checkpointer, guard,
                      objective=objective, callbacks=callbacks, resumed=ckpt is not None)
    if ckpt is not None:
        checkpointer.load(ckpt)
        trainer.guard.last_save = progress.global_step if "dcp_path" in ckpt else None  # a dropped step saves no copy
        # MiniMind's resume file counts steps within its epoch only: the schedule's step counts the epochs before
        progress.global_step = max(progress.global_step, progress.epoch * steps_per_epoch + progress.step_in_epoch)
        Logger(f"Resumed from epoch {progress.epoch}, step {progress.global_step} "
               f"({ckpt['world_size']} processes when saved)")
        note = resume_note(ckpt.get("args"), plan.lr, trainer.total_steps, steps_per_epoch)
        if note:
            Logger(note)
    return trainer


def steps_per_epoch(plan, train_ds):
    """Optimizer steps in one pass over `train_ds` (a partial last global batch is dropped)."""
    return len(train_ds) // plan.global_batch


def train(trainer, train_ds, eval_ds=None):
    """Phase 7, the loop: each step takes its micro-batches, runs train_step, then logs, evaluates, saves.

    SIGTERM/SIGINT stop it with a checkpoint of the last completed step (guard.py Preemption: one process drops
    the step in progress, several ranks finish it and stop together)."""
    plan, progress = trainer.plan, trainer.progress
    if trainer.resumed and (reached_max_steps(trainer) or stop_reason(trainer)):
        reason = stop_reason(trainer) or f"--max_steps {plan.max_steps}"
        Logger(f"{reason}: the checkpoint is already at step {progress.global_step}; nothing to train"
               + (" (raise --max_steps to train on)" if reason.startswith("--max_steps") else ""))
        ensure_final_weights(trainer)  # a weights save that failed (a full disk) is written before `Done`
        return finish(trainer)
    trainer.callbacks.insert(0, make_tracker(trainer))  # the sinks see each record first
    if is_main_process():
        write_run_config(plan)  # --config of it repeats this run
    profiler = StepProfiler(plan.profile_steps, os.path.join(plan.save_dir, "profile"), plan.device)
    timer = StepTimer(peak_flops(plan.device, plan.dtype) * plan.world_size)
    Logger(f"{trainer.steps_per_epoch} optimizer steps per epoch, global batch {plan.global_batch} x {plan.seq_len} "
           f"tokens, dtype {plan.dtype}; {plan.optim.name}, {plan.lr.describe(trainer.total_steps)}")
    # the bar closes before an error line is printed
    with trainer.guard.preemption, Bar(trainer) as bar, messages_above_bar(), out_of_memory_as_one_line(trainer):
        try:
            for epoch in range(progress.epoch, plan.epochs):
                if progress.step_in_epoch >= trainer.steps_per_epoch:  # saved at the end of this epoch
                    progress.step_in_epoch = 0
                    continue
                progress.epoch = epoch
                train_epoch(trainer, epoch_batches(trainer, train_ds, epoch), eval_ds, timer, profiler, bar)
                if should_stop(trainer):
                    break
                progress.step_in_epoch = 0
        except StepAbandoned:
            bar.close()
            save_abandoned(trainer)
        bar.close()  # the final bar once, above the last records (no-op when closed already)
        trainer.checkpointer.wait()  # the last async save
        profiler.close()
    trainer.callbacks.call("on_train_end", trainer)  # the sinks close
    finish(trainer)


def train_epoch(trainer, batches, eval_ds, timer, profiler, bar):
    """The steps of one epoch from where progress stands; the bar advances per micro-batch."""
    plan, progress, preemption = trainer.plan, trainer.progress, trainer.guard.preemption
    timer.reset()
    while progress.step_in_epoch < trainer.steps_per_epoch and not should_stop(trainer):
        profiler.begin(progress.global_step + 1)
        start = time.perf_counter()
        trainer.step_rng = rng_state() if preemption.abandon else None  # what a dropped step saves
        with preemption.abandonable():
            micro_batches = [next(batches) for _ in range(plan.num_microbatches)]
        metrics = train_step(trainer, micro_batches, bar)
        trim_heap(plan.device)  # batches of varying target counts fragment the CPU heap
        if not trainer.started:  # start-up (token cache, weights, compile) is over
            set_collective_timeout(plan.dist_timeout)
            trainer.started = True
        progress.step_in_epoch += 1
        rows = plan.micro_batch_shape[0] * plan.num_microbatches * plan.dp  # a DPO sample is two rows
        timer.add(metrics["num_tokens"], trainer.objective.flops(trainer.config, plan.seq_len, rows * plan.seq_len,
                                                                 metrics["num_tokens"], plan.chunked_loss))
        bar.step_end(trainer.guard.last_loss, metrics["lr"], metrics["num_tokens"] / (time.perf_counter() - start))
        epoch_end = progress.step_in_epoch == trainer.steps_per_epoch
        if should_stop(trainer) or (epoch_end and progress.epoch == plan.epochs - 1):
            bar.close()  # the last step: the final bar, then its record below it
        after_step(trainer, eval_ds, metrics, timer, epoch_end)


def after_step(trainer, eval_ds, metrics, timer, epoch_end):
    """Log, compare replicas, evaluate and save as the intervals say (the run's last step, or a preempted one, always,
    and a step past --save_every_minutes since the last save, agreed by the guard); the callbacks
    (trainer/callbacks.py: the sinks, early stopping, best checkpoint, a user's) see each record."""
    plan, step, guard, callbacks = trainer.plan, trainer.progress.global_step, trainer.guard, trainer.callbacks
    last = epoch_end or should_stop(trainer)
    logged = step % effective_log_interval(plan, trainer.steps_per_epoch) == 0 or step == 1 or last  # a first loss
    callbacks.call("on_step_end", trainer, step_record(trainer, metrics, timer) if logged else None)
    run_end = should_stop(trainer) or (epoch_end and trainer.progress.epoch == plan.epochs - 1)
    if plan.check_replicas and step % plan.check_replicas == 0 and plan.dp * plan.cp > 1:
        check_replicas(trainer.model_parts, trainer.dims.group("dp_cp"), step)
    scheduled = plan.eval_interval and step % plan.eval_interval == 0
    if eval_ds is not None and (scheduled or (run_end and not guard.stop)):
        callbacks.call("on_eval", trainer, evaluate(trainer, eval_ds))
    last = last or should_stop(trainer)  # a callback may have stopped the run (early stopping)
    if step % plan.save_interval == 0 or last or guard.save_due or callbacks.wants_save(step):
        trainer.checkpointer.save(step)
        guard.saved(step)
        callbacks.call("on_save", trainer, step)
    if last or (plan.save_weights_every and step % plan.save_weights_every == 0):
        save_weights(trainer)
    if guard.stop:
        Logger(f"preempted: stopped at step {step} with its checkpoint in {trainer.plan.checkpoint_dir}; "
               "continue with --from_resume 1")
    elif stop_reason(trainer):
        Logger(f"stopped: {stop_reason(trainer)}")


def save_abandoned(trainer):
    """A signal during a step's micro-batches (one process): drop their gradients and save the last completed step,
    whose parameters, optimizer state and progress are untouched, with the RNG state it ended with."""
    trainer.optimizer.zero_grad(set_to_none=True)
    guard, step = trainer.guard, trainer.progress.global_step
    guard.stop = True
    if step == 0:
        Logger("preempted: no optimizer step completed yet; nothing to save")
        return
    set_rng_state(trainer.step_rng)
    if guard.last_save != step:  # else that step's checkpoint is on disk already
        trainer.checkpointer.save(step)
        guard.saved(step)
        trainer.callbacks.call("on_save", trainer, step)
    save_weights(trainer)  # as a finished or preempted run leaves them
    Logger(f"preempted: dropped step {step + 1}; step {step} saved in {trainer.plan.checkpoint_dir}; "
           "continue with --from_resume 1")


def finish(trainer):
    """Say where the weights are (only when the run finished) and leave the process group."""
    if not trainer.guard.stop:
        Logger(f"Done: {trainer.progress.global_step} steps, weights in {weights_path(trainer.plan)}")
    if dist.is_initialized():
        dist.destroy_process_group()


def train_step(trainer, micro_batches, bar=None):
    """One optimizer step over `micro_batches` [(input_ids, labels[, position_ids])]; returns its measurements.

    The objective (trainer/objective.py; LM: CE over target tokens) gives each micro-batch's share of the step's
    mean, main loss / num_items (num_items: the step's denominator over all dp ranks, e.g. target tokens), plus
    aux * samples/global samples, so the sums over micro-batches and ranks are the step loss. The
    gradient is multiplied by dp*cp because DDP/FSDP average over those ranks. `bar`, a progress bar, advances
    per micro-batch.
    """
    plan, progress, scaler = trainer.plan, trainer.progress, trainer.scaler
    lr = lr_at(plan.lr, progress.global_step, trainer.total_steps)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    micro_batches = trainer.objective.prepare(trainer, micro_batches)  # e.g. GRPO: the prompts -> a rollout's rows
    with trainer.guard.preemption.abandonable():  # one process: a signal drops these micro-batches at once
        ce, aux, stats, num_items, num_tokens = accumulate_gradients(trainer, micro_batches, bar or NO_BAR)
    scaler.unscale_(trainer.optimizer)
    grad_norm = clip_gradients(trainer, plan.grad_clip)
    skip = trainer.guard.check(ce + aux, grad_norm, not scaler.is_enabled(), plan.device,  # agreed by every rank
                               found_inf=scaler_found_inf(scaler, trainer.optimizer),
                               shown_loss=ce if trainer.dims.counts_loss else 0.0)  # summed: the logged loss
    if not skip:
        scaler.step(trainer.optimizer)
    scaler.update()  # after a skip too: unscale_ recorded its inf checks
    trainer.optimizer.zero_grad(set_to_none=True)
    progress.global_step += 1
    progress.tokens_seen += num_tokens
    trainer.guard.record(skip, progress, plan.num_microbatches, ce + aux, grad_norm)
    return dict(ce=ce, aux=aux, lr=lr, num_items=num_items, num_tokens=num_tokens, stats=stats, grad_norm=grad_norm)


def accumulate_gradients(trainer, micro_batches, bar):
    """Forward and backward of every micro-batch (the pipeline's schedule, or a loop here), gradients accumulated;
    returns this rank's (CE share, aux share, stats, num_items, num_tokens) of the step."""
    plan, scaler, objective = trainer.plan, trainer.scaler, trainer.objective
    unpacked = [objective.unpack(batch) for batch in micro_batches]  # (input_ids, labels, positions, extra)
    counts = [objective.count(labels, extra) for _, labels, _, extra in unpacked]  # CPU: no device sync
    local_tokens = sum(counts) if objective.items_are_tokens else sum(
        target_tokens(labels) for _, labels, _, _ in unpacked)  # for tokens/s and MFU
    num_items, num_tokens = count_sum([sum(counts), local_tokens], plan.tp * plan.pp * plan.cp)  # over dp, on CPU
    # the loader pins its batches on CUDA, so these copies overlap with compute
    inputs, targets, doc_positions, extras = zip(*[(
        to_device(x, plan.device), to_device(step_targets(labels), plan.device), to_device(p, plan.device),
        tuple(to_device(e, plan.device) for e in extra)) for x, labels, p, extra in unpacked])
    aux_weight = plan.micro_batch / plan.global_batch / plan.cp  # every cp rank adds the (shared) aux
    grad_factor = grad_reduce_factor(plan.dp, plan.cp)
    if trainer.pipeline is not None:  # the schedule runs every micro-batch, forward and backward
        (x, t), positions = shard_for_context(trainer.dims, [torch.cat(inputs), torch.cat(targets)],
                                              None if doc_positions[0] is None else torch.cat(doc_positions))
        ce, aux, stats = trainer.pipeline.step(x, t, positions, num_items, aux_weight, grad_factor, scaler,
                                               objective, extras)
        bar.update(len(micro_batches))
        return ce, aux, stats, num_items, num_tokens
    model, ce, aux, stats = trainer.model_parts[0], 0.0, 0.0, {}
    for i, (x, t, p, extra) in enumerate(zip(inputs, targets, doc_positions, extras)):
        (x, t), positions = shard_for_context(trainer.dims, [x, t], p)
        # DDP and FSDP2 reduce gradients on the last micro-batch only
        with gradient_sync(trainer.model_parts, i == len(inputs) - 1), tp_loss_context(plan.tp > 1):
            with autocast(plan):
                main_loss, aux_loss, micro_stats = objective.loss(model, x, t, positions, extra, num_items)
            loss = main_loss + aux_loss * aux_weight
            scaler.scale(loss * grad_factor).backward()
        ce, aux = ce + local_value(main_loss), aux + local_value(aux_loss) * aux_weight
        stats = add_stats(stats, micro_stats)
        if not plan.device.startswith("cuda"):  # free on CPU; on CUDA the bar waits for the step's own sync
            bar.running_loss(ce, sum(counts[:i + 1]), num_items)
        bar.update(1)  # shows the loss just set
    return ce, aux, stats, num_items, num_tokens


def clip_gradients(trainer, max_norm):
    """Clip over every rank's gradients; a pipeline's tied embedding copies are summed first, counted once."""
    pipeline = trainer.pipeline
    if pipeline is not None:
        pipeline.sync_tied_grads()
    params = [p for part in trainer.model_parts for p in part.parameters() if p.grad is not None]
    pp_group = trainer.dims.group("pp") if trainer.plan.pp > 1 else None
    return clip_grad_norm_(params, max_norm, pp_group=pp_group,
                           exclude=pipeline.duplicate_params() if pipeline is not None else None)


def reached_max_steps(trainer):
    return bool(trainer.plan.max_steps) and trainer.progress.global_step >= trainer.plan.max_steps


def stop_reason(trainer):
    """Why the run ends early after this step: --max_tokens reached, or a callback's reason (early stopping)."""
    plan, progress = trainer.plan, trainer.progress
    if plan.max_tokens and progress.tokens_seen >= plan.max_tokens:
        return f"--max_tokens {plan.max_tokens}: {progress.tokens_seen} target tokens at step {progress.global_step}"
    return trainer.callbacks.stop_reason() if trainer.callbacks is not None else None


def should_stop(trainer):
    """--max_steps or --max_tokens reached, a callback stopped the run, or every rank agreed to stop after a signal."""
    return reached_max_steps(trainer) or trainer.guard.stop or stop_reason(trainer) is not None


def epoch_batches(trainer, train_ds, epoch):
    """This rank's micro-batches of `epoch`, after the ones a resumed run already trained on."""
    plan = trainer.plan
    skip = trainer.progress.step_in_epoch * plan.num_microbatches
    return iter(epoch_loader(train_ds, epoch, plan.seed, plan.micro_batch, plan.dp, trainer.dims.dp_rank,
                             plan.num_workers, plan.device.startswith("cuda"), skip))
