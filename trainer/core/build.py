"""Phases 1 and 4-7 of every stage: `setup` (the flags checked into the plan, the process group, the mesh, the seed)
and `build_trainer` (resume state, model, parallel wrap, optimizer, restore) into the `Trainer` the loop runs
(trainer/core/loop.py)."""
import os
from dataclasses import dataclass
from typing import Optional

import torch

from model.model_minimind import MiniMindConfig
from trainer.base.launch import init_distributed_mode, rank, setup_seed
from trainer.base.log import Logger
from trainer.base.rank_log import open_rank_log
from trainer.ckpt.checkpointer import Checkpointer
from trainer.ckpt.parts import standard_parts
from trainer.ckpt.resume import TrainState, check_resume_early, read_resume, tied_aliases
from trainer.ckpt.run_lock import claim_run
from trainer.ckpt.storage import checkpoint_room
from trainer.ckpt.weights_file import base_record, init_model
from trainer.observe.metrics import enable_tf32
from trainer.parallel.mesh import ParallelDims
from trainer.parallel.parallelize import parallelize
from trainer.plan.checks import check_same_dtype
from trainer.plan.objective import LMObjective
from trainer.plan.resolve import resolve
from trainer.plan.sections import TrainPlan
from trainer.plan.stage import Stage
from trainer.runtime.callbacks import Callbacks, make_callbacks
from trainer.runtime.optimizer_choice import build_optimizer
from trainer.runtime.schedule import resume_note
from trainer.runtime.signals import Preemption, add_signal_points
from trainer.runtime.step_guard import StepGuard


@dataclass
class Trainer:
    """What a step needs: the plan, where this rank sits, what it trains, and where training stands."""
    plan: TrainPlan
    config: MiniMindConfig
    dims: ParallelDims
    model_parts: list  # this rank's pipeline stages, or [model]
    pipeline: Optional[object]  # trainer/parallel/pipeline.py Pipeline when pp > 1
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    progress: TrainState
    steps_per_epoch: int
    total_steps: int  # of the lr schedule (all epochs, or --max_steps)
    checkpointer: Checkpointer
    guard: StepGuard  # non-finite skips and the agreed preemption stop
    objective: Optional[LMObjective] = None  # what train_step minimises (a stage's subclass); build_trainer sets it
    callbacks: Optional[Callbacks] = None  # sinks, early stopping, best checkpoint, a user's
    resumed: bool = False
    expert_load: Optional[object] = None  # a MoE model's per-expert loads and routing bias (runtime/expert_load.py)
    started: bool = False  # the first step is done: collectives run under the per-step timeout
    step_rng: dict = None  # RNG states as the step in progress began (one process: a dropped step saves them)
    from_weight: Optional[dict] = None  # what --from_weight's sidecar says of its run (weights_file.base_record)


def setup(args, stage=Stage):
    """Phase 1: check the flags into a TrainPlan (with the checked plan of `stage`, a trainer/plan/stage.py Stage
    class), start the process group and mesh, seed. Returns (plan, dims)."""
    plan = resolve(args, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)), stage)
    layout, model = plan.layout, plan.model
    if model.deterministic:  # read by cuBLAS when CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_distributed_mode(layout.device, layout.dist_init_timeout)
    open_rank_log(plan.io.log_dir, plan.io.run_name, f"{plan.io.run_name}, rank {rank()} of {layout.world_size}")
    enable_tf32(layout.device, strict=not model.tf32)  # before peak_flops reads the matmul precision
    dims = ParallelDims.build(layout.world_size, device_type=torch.device(layout.device).type, **layout.model_sizes)
    Logger(dims.summary())
    if model.dtype_note:  # --dtype auto
        check_same_dtype(model.dtype, layout.device)  # each rank measured (or read) the rates itself
        Logger(model.dtype_note)
    setup_seed(plan.data.seed, model.deterministic)  # same seed on every rank: every rank builds the same full model
    check_resume_early(plan)
    return plan, dims


def build_model(config, plan, model_state=None, resumed=False):
    """The plain full model on the plan's device: --from_weight (or resume) weights, else the seeded init."""
    note = "weights from the checkpoint resumed below" if resumed else None  # not --seed's, nor --from_weight's
    model = init_model(config, plan.model.from_weight, note=note)
    if model_state is not None:
        model.load_state_dict(model_state)
    return model.to(plan.layout.device)


def build_trainer(plan, dims, steps_per_epoch, objective=None):
    """Phases 4-7: resume state, model, parallel wrap, optimizer, restore; the Trainer can run train_step at once.

    objective: what the stage minimises (plan.stage.objective(...), trainer/plan/objective.py); None: LMObjective."""
    config = plan.model.config
    claim_run(plan)  # one run per checkpoint directory; an earlier run's results are not replaced unasked
    ckpt = read_resume(config, plan)
    model = build_model(config, plan, ckpt.get("model") if ckpt else None, ckpt is not None)  # DCP: in restore
    model = plan.stage.prepare_model(model)  # e.g. LoRA: adapters on the plain loaded model, base frozen
    estimate = checkpoint_room(model, plan)  # a checkpoint's bytes; a line when --checkpoint_dir lacks the room
    moe = None
    if config.use_moe:  # a MoE model's routing bias, expert compute and loads: read by MoE runs only
        from trainer.runtime import expert_load as moe
        moe.before_wrap(model, plan)  # the bias is model state: there before the wrap and the resume
    model_parts, pipeline = parallelize(model, dims, plan)  # in the order its docstring states
    expert_load = moe.after_wrap(model_parts, plan, dims) if moe else None  # how experts run, their loads
    if plan.layout.world_size == 1 and not plan.model.use_compile:  # a signal drops a step between backward blocks
        add_signal_points(model_parts)
    optimizer = build_optimizer(model_parts, plan, dims)  # --optimizer (runtime/optimizer_choice.py), ZeRO-1 or not
    scaler = torch.amp.GradScaler(torch.device(plan.layout.device).type, enabled=plan.model.dtype == torch.float16)
    progress, objective, callbacks = TrainState(), objective or LMObjective(), make_callbacks(plan)
    parts = standard_parts(model_parts, optimizer, tied_aliases(pipeline, config), scaler, progress, objective,
                           callbacks)  # a stage's own part: trainer.checkpointer.register(Part(...))
    checkpointer = Checkpointer(plan.io.run_dir, plan.io.async_save, plan.io.keep_checkpoints, parts=parts, plan=plan,
                                config=config, estimate=estimate)
    guard = StepGuard(plan.guard.max_bad_steps,
                      Preemption(plan.guard.grace_seconds, abandon=plan.layout.world_size == 1),
                      plan.schedule.save_every_minutes * 60)
    trainer = Trainer(plan, config, dims, model_parts, pipeline, optimizer, scaler, progress, steps_per_epoch,
                      plan.lr.length(steps_per_epoch, plan.schedule.epochs), checkpointer, guard,
                      objective=objective, callbacks=callbacks, resumed=ckpt is not None, expert_load=expert_load)
    trainer.from_weight = base_record(plan.model.from_weight)  # this run's sidecar repeats it
    if ckpt is not None:  # phase 7: the checkpoint's state into the wrapped parts, then the schedule's note
        checkpointer.restore(ckpt, progress, steps_per_epoch)
        trainer.guard.last_save = progress.global_step if "dcp_path" in ckpt else None  # a dropped step saves no copy
        note = resume_note(ckpt.get("args"), plan.lr, trainer.total_steps, steps_per_epoch)
        if note:
            Logger(note)
    return trainer


def steps_per_epoch(plan, train_ds):
    """Optimizer steps in one pass over `train_ds` (a partial last global batch is dropped)."""
    return len(train_ds) // plan.data.global_batch
