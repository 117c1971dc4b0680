"""The training loop every stage runs: `train()` (phase 8, the loop) and `train_step()` (one optimizer step), on the
Trainer that trainer/core/build.py's `setup` and `build_trainer` make. Entry scripts import it; stage modules never do
(they sit below it).

Read `train()` for the loop and `train_step()` for one optimizer step. The plan and its sections live in
trainer/plan/sections.py (resolved by trainer/plan/resolve.py), what a stage gives the loop in trainer/plan/stage.py and
trainer/plan/objective.py, data in trainer/core/data_loading.py, a batch's way into the model in
trainer/core/batches.py, checkpoints in trainer/ckpt/checkpointer.py, the console and records in
trainer/observe/console.py, evaluation in trainer/core/evaluation.py, the callbacks in trainer/runtime/callbacks.py,
the parallel dimensions in trainer/parallel/ (applied by trainer/parallel/parallelize.py).
"""
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist

from trainer.base.errors import SignalStop
from trainer.base.launch import OUTSIDE_LOOP, add_stats, count_sum, full_value, is_main_process, set_collective_timeout
from trainer.base.log import Logger
from trainer.ckpt.step_dirs import rng_state
from trainer.ckpt.weights_file import ensure_final_weights, save_weights
from trainer.core.batches import autocast, loss_context, shard_for_context, step_targets, to_device
from trainer.core.data_loading import epoch_loader, row_collate
from trainer.core.evaluation import evaluate
from trainer.observe.console import (
    NO_BAR,
    Bar,
    effective_log_interval,
    make_tracker,
    messages_above_bar,
    run_line,
    step_record,
)
from trainer.observe.metrics import start_up_frozen, step_flops_of, step_timer, trim_heap
from trainer.parallel.clip import clip_model_gradients
from trainer.parallel.mesh import dimension_module, grad_reduce_factor
from trainer.plan.config_file import write_run_config
from trainer.plan.objective import target_tokens
from trainer.runtime.out_of_memory import out_of_memory_as_one_line
from trainer.runtime.schedule import lr_at
from trainer.runtime.signals import StepAbandoned, save_abandoned
from trainer.runtime.step_guard import scaler_found_inf


def train(trainer, train_ds, eval_ds=None):
    """Phase 8, the loop: each step takes its micro-batches, runs train_step, then logs, evaluates, saves.

    SIGTERM/SIGINT stop it with a checkpoint of the last completed step (signals.py Preemption: one process drops
    the step in progress, several ranks finish it and stop together)."""
    plan, progress = trainer.plan, trainer.progress
    if trainer.resumed and (reached_max_steps(trainer) or stop_reason(trainer)):
        reason = stop_reason(trainer) or f"--max_steps {plan.schedule.max_steps}"
        Logger(f"{reason}: the checkpoint is already at step {progress.global_step}; nothing to train"
               + (" (raise --max_steps to train on)" if reason.startswith("--max_steps") else ""))
        ensure_final_weights(trainer)  # a weights save that failed (a full disk) is written before `Done`
        return finish(trainer)
    trainer.callbacks.insert(0, make_tracker(trainer))  # the sinks see each record first
    if is_main_process():
        write_run_config(plan)  # --config of it repeats this run
    profiler = step_profiler(plan)
    timer = step_timer(plan.layout.device, plan.model.dtype, plan.layout.world_size)
    Logger(run_line(trainer))  # the steps the bar counts to
    # the bar closes before an error line is printed
    with trainer.guard.preemption, Bar(trainer) as bar, messages_above_bar(), out_of_memory_as_one_line(trainer), \
            start_up_frozen():
        try:
            for epoch in range(progress.epoch, plan.schedule.epochs):
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
        if profiler is not None:
            profiler.close()
    OUTSIDE_LOOP["when"] = f"after the training loop; step {progress.global_step} is saved"
    trainer.callbacks.call("on_train_end", trainer)  # the sinks close
    finish(trainer)


def step_profiler(plan):
    """--profile_steps A:B: the StepProfiler of those steps, under <save_dir>/profile (its module is read by these runs
    only); None without the flag."""
    if plan.io.profile_steps is None:
        return None
    from trainer.observe.step_profiler import StepProfiler
    return StepProfiler(plan.io.profile_steps, os.path.join(plan.io.save_dir, "profile"), plan.layout.device)


def train_epoch(trainer, batches, eval_ds, timer, profiler, bar):
    """The steps of one epoch from where progress stands; the bar advances per micro-batch."""
    plan, progress, preemption = trainer.plan, trainer.progress, trainer.guard.preemption
    timer.reset()
    while progress.step_in_epoch < trainer.steps_per_epoch and not should_stop(trainer):
        if profiler is not None:
            profiler.begin(progress.global_step + 1)
        trainer.step_rng = rng_state() if preemption.abandon else None  # what a dropped step saves
        with preemption.abandonable():
            micro_batches = [next(batches) for _ in range(plan.data.num_microbatches)]
        metrics = train_step(trainer, micro_batches, bar)
        trim_heap(plan.layout.device)  # batches of varying target counts fragment the CPU heap
        if not trainer.started:  # start-up (token cache, weights, compile) is over
            set_collective_timeout(plan.layout.dist_timeout)
            trainer.started = True
        progress.step_in_epoch += 1
        timer.add(metrics["num_tokens"], step_flops_of(trainer, micro_batches, metrics["num_tokens"]))  # for MFU
        bar.step_end(trainer.guard.last_loss, metrics["lr"], timer.window_tokens_per_sec())  # the record's window
        epoch_end = progress.step_in_epoch == trainer.steps_per_epoch
        if should_stop(trainer) or (epoch_end and progress.epoch == plan.schedule.epochs - 1):
            bar.close()  # the last step: the final bar, then its record below it
        after_step(trainer, eval_ds, metrics, timer, epoch_end)


def after_step(trainer, eval_ds, metrics, timer, epoch_end):
    """Log, compare replicas, evaluate and save as the intervals say (the run's last step, or a preempted one, always,
    and a step past --save_every_minutes since the last save, agreed by the guard); the callbacks
    (trainer/runtime/callbacks.py: the sinks, early stopping, best checkpoint, a user's) see each record."""
    plan, step, guard, callbacks = trainer.plan, trainer.progress.global_step, trainer.guard, trainer.callbacks
    last = epoch_end or should_stop(trainer)
    logged = step % effective_log_interval(plan, trainer.steps_per_epoch) == 0 or step == 1 or last  # a first loss
    record = step_record(trainer, metrics, timer) if logged else None
    if trainer.expert_load is not None:  # the bias update, and the loads into the record before the sinks see it
        trainer.expert_load.step_end(step, record)
    callbacks.call("on_step_end", trainer, record)
    run_end = should_stop(trainer) or (epoch_end and trainer.progress.epoch == plan.schedule.epochs - 1)
    if plan.guard.check_replicas and step % plan.guard.check_replicas == 0 and grad_reduce_factor(plan.layout) > 1:
        dimension_module("dp").check_replicas(trainer.model_parts, trainer.dims.group("dp_cp"), step)
    scheduled = plan.schedule.eval_interval and step % plan.schedule.eval_interval == 0
    if eval_ds is not None and (scheduled or (run_end and not guard.stop)):
        callbacks.call("on_eval", trainer, evaluate(trainer, eval_ds))
    last = last or should_stop(trainer)  # a callback may have stopped the run (early stopping)
    if step % plan.schedule.save_interval == 0 or last or guard.save_due or callbacks.wants_save(step):
        trainer.checkpointer.save(step)
        guard.saved(step)
        callbacks.call("on_save", trainer, step)
    if last or (plan.schedule.save_weights_every and step % plan.schedule.save_weights_every == 0):
        ended = should_stop(trainer) or (epoch_end and trainer.progress.epoch == plan.schedule.epochs - 1)
        save_weights(trainer, finished=ended and not guard.stop)  # an early stop (--max_tokens, a callback) finishes
    if guard.stop:
        Logger(f"preempted: stopped at step {step} with its checkpoint in {trainer.plan.io.run_dir}; "
               "continue with --from_resume 1")
    elif stop_reason(trainer):
        Logger(f"stopped: {stop_reason(trainer)}")


def finish(trainer):
    """Say where the weights are (only when the run finished) and leave the process group; a run stopped by a signal
    (saved) raises SignalStop: exit 130/143, so `train && next_stage` does not go on from a stopped run."""
    plan = trainer.plan
    if not trainer.guard.stop:
        steps = trainer.progress.global_step
        Logger(f"Done: {steps} step{'s' * (steps != 1)}, weights in {plan.stage.weights_path(plan)}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if trainer.guard.stop:
        raise SignalStop(trainer.guard.stop_signal)


def train_step(trainer, micro_batches, bar=None):
    """One optimizer step over `micro_batches` [(input_ids, labels[, position_ids])]; returns its measurements.

    The objective (trainer/plan/objective.py; LM: CE over target tokens) gives each micro-batch's share of the step's
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
    with trainer.guard.preemption.abandonable(gradients=True):  # one process: a signal drops these micro-batches
        ce, aux, stats, num_items, num_tokens = accumulate_gradients(trainer, micro_batches, bar or NO_BAR)
    scaler.unscale_(trainer.optimizer)
    grad_norm = clip_model_gradients(trainer.model_parts, plan.optim.grad_clip, trainer.dims, trainer.pipeline)
    skip = trainer.guard.check(ce + aux, grad_norm, not scaler.is_enabled(), plan.layout.device,  # agreed by every rank
                               found_inf=scaler_found_inf(scaler, trainer.optimizer),
                               shown_loss=ce if trainer.dims.counts_loss else 0.0)  # summed: the logged loss
    if not skip:
        scaler.step(trainer.optimizer)
    scaler.update()  # after a skip too: unscale_ recorded its inf checks
    trainer.optimizer.zero_grad(set_to_none=True)
    progress.global_step += 1
    progress.tokens_seen += num_tokens
    trainer.guard.record(skip, progress, plan.data.num_microbatches, ce + aux, grad_norm)
    return dict(ce=ce, aux=aux, lr=lr, num_items=num_items, num_tokens=num_tokens, stats=stats, grad_norm=grad_norm)


def accumulate_gradients(trainer, micro_batches, bar):
    """Forward and backward of every micro-batch (the pipeline's schedule, or a loop here), gradients accumulated;
    returns this rank's (CE share, aux share, stats, num_items, num_tokens) of the step."""
    plan, scaler, objective = trainer.plan, trainer.scaler, trainer.objective
    unpacked = [objective.unpack(batch) for batch in micro_batches]  # (input_ids, labels, positions, extra)
    counts = [objective.count(labels, extra) for _, labels, _, extra in unpacked]  # CPU: no device sync
    local_tokens = sum(counts) if objective.items_are_tokens else sum(
        target_tokens(labels) for _, labels, _, _ in unpacked)  # for tokens/s and MFU
    layout, device = plan.layout, plan.layout.device
    num_items, num_tokens = count_sum([sum(counts), local_tokens], layout.copies_of_data)  # over dp, CPU
    # the loader pins its batches on CUDA, so these copies overlap with compute
    inputs, targets, doc_positions, extras = zip(*[(
        to_device(x, device), to_device(step_targets(labels), device), to_device(p, device),
        tuple(to_device(e, device) for e in extra)) for x, labels, p, extra in unpacked])
    aux_weight = plan.data.micro_batch / plan.data.global_batch / layout.cp  # every cp rank adds the (shared) aux
    grad_factor = grad_reduce_factor(layout)
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
        with gradient_sync(layout, trainer.model_parts, i == len(inputs) - 1), loss_context(layout.tp):
            with autocast(plan):
                main_loss, aux_loss, micro_stats = objective.loss(model, x, t, positions, extra, num_items)
            loss = main_loss + aux_loss * aux_weight
            scaler.scale(loss * grad_factor).backward()
        ce, aux = ce + full_value(main_loss), aux + full_value(aux_loss) * aux_weight
        stats = add_stats(stats, micro_stats)
        if not device.startswith("cuda"):  # free on CPU; on CUDA the bar waits for the step's own sync
            bar.running_loss(ce, sum(counts[:i + 1]), num_items)
        bar.update(1)  # shows the loss just set
    return ce, aux, stats, num_items, num_tokens


def gradient_sync(layout, model_parts, last):
    """The context of one micro-batch's backward: under a data-parallel group (parallel/data.py gradient_sync),
    gradients are reduced on the last micro-batch only; without one there is nothing to reduce."""
    if layout.dp_mode == "none":
        return nullcontext()
    return dimension_module("dp").gradient_sync(model_parts, last)


def reached_max_steps(trainer):
    max_steps = trainer.plan.schedule.max_steps
    return bool(max_steps) and trainer.progress.global_step >= max_steps


def stop_reason(trainer):
    """Why the run ends early after this step: --max_tokens reached, or a callback's reason (early stopping)."""
    max_tokens, progress = trainer.plan.schedule.max_tokens, trainer.progress
    if max_tokens and progress.tokens_seen >= max_tokens:
        return f"--max_tokens {max_tokens}: {progress.tokens_seen} target tokens at step {progress.global_step}"
    return trainer.callbacks.stop_reason() if trainer.callbacks is not None else None


def should_stop(trainer):
    """--max_steps or --max_tokens reached, a callback stopped the run, or every rank agreed to stop after a signal."""
    return reached_max_steps(trainer) or trainer.guard.stop or stop_reason(trainer) is not None


def epoch_batches(trainer, train_ds, epoch):
    """This rank's micro-batches of `epoch`, after the ones a resumed run already trained on (their rows cut to the
    longest where the plan says: trainer/core/data_loading.py row_collate)."""
    plan, data, layout = trainer.plan, trainer.plan.data, trainer.plan.layout
    skip = trainer.progress.step_in_epoch * data.num_microbatches
    return iter(epoch_loader(train_ds, epoch, data.seed, data.micro_batch, layout.dp, trainer.dims.rank("dp"),
                             data.num_workers, layout.device.startswith("cuda"), skip, row_collate(plan, train_ds)))
