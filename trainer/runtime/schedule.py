"""The learning-rate schedule: warm-up, then cosine (MiniMind's), linear, warmup-stable-decay or constant; the peak
scaled with the global batch (the large-batch rules: linear or square root against --base_batch).

The schedule spans the run's optimizer steps: --max_steps when set, else every epoch. MiniMind's default is
`lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))` after warm-up: cosine from the peak down to a floor of 0.1 * lr,
which `--min_lr` moves; `lr_at` computes it as min + (peak - min) / 2 * (1 + cos), with the floor as a ratio of
the peak, so the default curve is bit for bit MiniMind's (0.1 + (1 - 0.1) / 2 * (...) rounds to the same doubles).
"""
import math
from dataclasses import dataclass

from model.errors import ConfigError
from trainer.base.schema import Flag

SCHEDULES = ("cosine", "linear", "wsd", "constant")
SCALINGS = ("none", "linear", "sqrt")
MINIMIND_FLOOR = 0.1  # MiniMind's cosine ends at 0.1 * lr


@dataclass(frozen=True)
class LRSchedule:
    """The learning-rate schedule (the plan's `lr`; trainer/runtime/schedule.py); its length comes with the step
    count."""
    kind: str  # cosine | linear | wsd | constant
    peak: float  # --learning_rate after --lr_scaling
    floor_ratio: float  # the last value / peak (--min_lr / peak; MiniMind's 0.1 by default)
    warmup_steps: int
    decay_fraction: float  # wsd: the last fraction of the post-warm-up steps decays
    max_steps: int  # 0: the schedule spans every epoch (--max_steps)
    scaling_note: str = ""  # how the peak came from --learning_rate (printed at start)
    FLAGS = (
        Flag("warmup_steps", int, 0, "linear warm-up steps before the --lr_schedule", min=0),
        Flag("learning_rate", float, 5e-4, "peak learning rate of the schedule (MiniMind's cosine)"),
        Flag("lr_schedule", str, "cosine", "after --warmup_steps: cosine (MiniMind's), linear decay, wsd "
             "(warmup-stable-decay: the peak, then a linear decay over the last --wsd_decay_fraction), constant; down "
             "to --min_lr", choices=SCHEDULES),
        Flag("min_lr", float, None, "the schedule's last lr (default: MiniMind's 0.1 x the peak)"),
        Flag("wsd_decay_fraction", float, 0.1, "--lr_schedule wsd: the fraction of the steps after warm-up that "
             "decays"),
        Flag("lr_scaling", str, "none", "scale --learning_rate by global batch / --base_batch (linear) or its square "
             "root (sqrt)", choices=SCALINGS),
        Flag("base_batch", int, None, "the global batch in samples that --learning_rate was tuned for (with "
             "--lr_scaling)", min=1),
    )

    def length(self, steps_per_epoch, epochs):
        """Optimizer steps the schedule spans: --max_steps when set (and shorter), else every epoch."""
        return schedule_length(steps_per_epoch, epochs, self.max_steps)

    def describe(self, total_steps):
        """One line for the start of a run: the resolved peak, shape, length and floor."""
        warmup = f"{self.warmup_steps} warm-up steps, then " if self.warmup_steps else ""
        shape = "constant" if self.kind == "constant" else (
            f"{self.kind} to {self.peak * self.floor_ratio:.3e}"
            + (f" over its last {self.decay_fraction:.0%}" if self.kind == "wsd" else ""))
        return f"lr {self.peak:.3e}{self.scaling_note}: {warmup}{shape}, {total_steps} steps"


def schedule_length(steps_per_epoch, epochs, max_steps):
    """The run's optimizer steps: every epoch, or --max_steps when it stops earlier."""
    total = steps_per_epoch * epochs
    return min(total, max_steps) if max_steps else total


def lr_at(schedule, step, total_steps):
    """The learning rate of optimizer step `step` (0-based: the number of steps already taken) of `total_steps`."""
    peak, m = schedule.peak, schedule.floor_ratio
    warmup = schedule.warmup_steps
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup  # linear warm-up (MiniMind's formula)
    if schedule.kind == "constant":
        return peak
    t, span = step - warmup, max(1, total_steps - warmup)
    progress = min(t, span) / span
    if schedule.kind == "cosine":
        return peak * (m + (1 - m) / 2 * (1 + math.cos(math.pi * min(t, span) / span)))  # MiniMind's rounding
    if schedule.kind == "linear":
        return peak * (m + (1 - m) * (1 - progress))
    decay = max(1, round(schedule.decay_fraction * span))  # wsd: stable at the peak, then linear to the floor
    into_decay = min(max(0, t - (span - decay)), decay) / decay
    return peak * (m + (1 - m) * (1 - into_decay))


def resolve_schedule(args, global_batch):
    """--lr_schedule and friends -> the LRSchedule (ConfigError for values that cannot be meant)."""
    if args.lr_schedule not in SCHEDULES:
        raise ConfigError(f"--lr_schedule must be one of {', '.join(SCHEDULES)} (got {args.lr_schedule})")
    if args.lr_scaling not in SCALINGS:
        raise ConfigError(f"--lr_scaling must be one of {', '.join(SCALINGS)} (got {args.lr_scaling})")
    peak, note = args.learning_rate, ""
    if args.lr_scaling != "none":
        if not args.base_batch:
            raise ConfigError(f"--lr_scaling {args.lr_scaling} scales --learning_rate by the global batch against "
                              "--base_batch: give --base_batch, the global batch (samples) that lr was tuned for")
        ratio = global_batch / args.base_batch
        factor = ratio if args.lr_scaling == "linear" else math.sqrt(ratio)
        peak = args.learning_rate * factor
        rule = f"{global_batch}/{args.base_batch}" if args.lr_scaling == "linear" else \
            f"sqrt({global_batch}/{args.base_batch})"
        note = f" (--learning_rate {args.learning_rate:g} x {rule}, --lr_scaling {args.lr_scaling})"
    if args.min_lr is None:
        floor = MINIMIND_FLOOR
    elif not (math.isfinite(args.min_lr) and 0 <= args.min_lr <= peak):
        raise ConfigError(f"--min_lr must be between 0 and the peak lr {peak:g} (got {args.min_lr})")
    else:
        floor = args.min_lr / peak if peak > 0 else 0.0
    if not 0 < args.wsd_decay_fraction <= 1:
        raise ConfigError(f"--wsd_decay_fraction must be in (0, 1] (got {args.wsd_decay_fraction})")
    return LRSchedule(kind=args.lr_schedule, peak=peak, floor_ratio=floor, warmup_steps=args.warmup_steps,
                      decay_fraction=args.wsd_decay_fraction, max_steps=args.max_steps, scaling_note=note)


def resume_note(saved_flags, schedule, total_steps, steps_per_epoch):
    """One line when a resumed run's schedule spans another number of steps than the checkpoint's did, else None
    (raising --max_steps to train on stretches the schedule from the resumed step on)."""
    saved = saved_flags or {}
    if "max_steps" not in saved or "epochs" not in saved:
        return None
    before = schedule_length(steps_per_epoch, saved["epochs"], saved["max_steps"])
    if before == total_steps:
        return None
    return (f"the lr schedule now spans {total_steps} steps (the checkpoint's run: {before}, from --max_steps and "
            "--epochs): it goes on along the new curve from the resumed step")
