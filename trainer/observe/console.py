"""What the console shows of a run: one progress bar over the whole run, the records the loop logs, and every other
message on a line of its own.

The bar's loss is the log line's: in one process a running mean over the step's micro-batches so far (exact at the
step's end), and at every step's end the step loss summed over ranks by the guard's one all-reduce, so no
micro-batch adds a collective.
"""
import sys
import warnings
from contextlib import contextmanager

from tqdm import tqdm

from dataset.mixture import describe_mixture, leaf_datasets
from trainer.base.launch import is_main_process, per_rank, world_sum
from trainer.base.log import say
from trainer.ckpt.step_dirs import latest_checkpoint
from trainer.observe.metrics import peak_mem_gb
from trainer.observe.tracking import Tracker

DEFAULT_LOG_INTERVAL = 100  # MiniMind's


def effective_log_interval(plan, steps_per_epoch):
    """--log_interval as typed; unset, MiniMind's 100 or fewer, so that an epoch has at least ten records."""
    return plan.schedule.log_interval or min(DEFAULT_LOG_INTERVAL, max(1, steps_per_epoch // 10))


def data_lines(plan, data_path, train_ds, eval_ds):
    """What phase 2 says about the data (trainer/core/data_loading.py load_datasets): skipped bad rows, each dataset's
    notes, the rows the steps per epoch come from, the realised mixture. A dataset that refuses its rows raises
    ValueError (every DPO pair with chosen == rejected)."""
    lines = []
    for path, ds in ((data_path, train_ds), (plan.data.eval_data_path, eval_ds)):
        skipped = sum(getattr(d, "num_bad_lines", 0) for d in leaf_datasets(ds))
        if skipped:  # only with --skip_bad_lines 1; otherwise a bad row stops the run
            lines.append(f"--skip_bad_lines: skipped {skipped} bad rows of {path}")
    # rows without targets, conversations cut at --max_seq_len, DPO pairs with chosen == rejected
    lines += [line for ds in leaf_datasets(train_ds) + leaf_datasets(eval_ds) for line in dataset_notes(ds)]
    lines.append(f"Data: {data_path} ({rows_line(train_ds, plan.data.seq_len)}), tokenizer {plan.data.tokenizer_path}")
    mixture = describe_mixture(train_ds, data_path)
    return lines + ([mixture] if mixture else [])


def dataset_notes(ds):
    """The info lines a dataset gives about what it loses or lacks (its `notes()`: chat, preference and prompt data,
    dataset/chat.py, preference_data.py, rlaif_dataset.py); none for pretraining's rows."""
    return ds.notes() if hasattr(ds, "notes") else []


def rows_line(ds, seq_len):
    """What the training rows are: '8177 rows of 64 tokens packed from 5026 documents' (the file's lines; SFT: the
    conversations with a target, the others are left out), '5026 rows, one per document' or '600 samples' (pairs,
    prompts): the count the steps per epoch come from."""
    leaves = leaf_datasets(ds)
    documents = [len(leaf.offsets) - 1 for leaf in leaves if getattr(leaf, "offsets", None) is not None]
    if len(documents) < len(leaves) or not leaves:  # a dataset without a token cache (pairs, prompts)
        return f"{len(ds)} samples"
    unit = "documents" if all(getattr(leaf, "kind", None) == "pretrain" for leaf in leaves) else "conversations"
    if any(getattr(leaf, "packing", False) for leaf in leaves):  # SFT packs the conversations with a target only
        packed = sum(len(leaf.row_docs) if getattr(leaf, "row_docs", None) is not None else n
                     for leaf, n in zip(leaves, documents))
        return f"{len(ds)} rows of {seq_len} tokens packed from {packed} {unit}"
    return f"{len(ds)} rows, one per {unit[:-1]}" if len(ds) == sum(documents) else \
        f"{len(ds)} rows from {sum(documents)} {unit}"


def run_steps(trainer):
    """'3 optimizer steps (--max_steps 3; one epoch is 2044)' or '4088 optimizer steps (2 epochs x 2044)': the run's
    length in one phrase, the number the bar counts to."""
    schedule, per_epoch, total = trainer.plan.schedule, trainer.steps_per_epoch, trainer.total_steps
    steps = f"{total} optimizer step{'s' * (total != 1)}"
    if schedule.max_steps and schedule.max_steps < per_epoch * schedule.epochs:
        return f"{steps} (--max_steps {schedule.max_steps}; one epoch is {per_epoch})"
    return f"{steps} ({schedule.epochs} epoch{'s' * (schedule.epochs > 1)} x {per_epoch})"


def run_line(trainer):
    """The line before the bar: the run's length, its batch, dtype, optimizer and schedule."""
    plan = trainer.plan
    return (f"{run_steps(trainer)}, global batch {plan.data.global_batch} x {plan.data.seq_len} tokens, dtype "
            f"{str(plan.model.dtype)[6:]}; {plan.optim.name}, {plan.lr.describe(trainer.total_steps)}")


class Bar:
    """One tqdm bar over the micro-batches of the whole run (all epochs, or up to --max_steps): its ETA is the run's.
    Its label says what it counts ('3 steps x 8 mb' counts to 24), the same steps as the line before it.

    `running_loss` (one process: free) and `step_end` (the agreed step loss) set the loss it shows."""

    def __init__(self, trainer):
        plan, progress, steps = trainer.plan, trainer.progress, trainer.total_steps
        self.single = plan.layout.world_size == 1
        micro = plan.data.num_microbatches
        label = f"{steps} steps" + (f" x {micro} mb" if micro > 1 else "")
        self.tqdm = tqdm(total=steps * micro, initial=progress.global_step * micro, desc=label,
                         unit="mb" if micro > 1 else "step", disable=not is_main_process(), dynamic_ncols=True,
                         mininterval=1.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()  # before an error line is printed

    def update(self, n=1):
        self.tqdm.update(n)

    def running_loss(self, loss_share, items_so_far, num_items):
        """One process: the mean loss over the micro-batches run so far (their share of the step's mean, rescaled to
        the items seen), shown with the next update. With several ranks the share is this rank's only: not shown."""
        if self.single and items_so_far:
            self.tqdm.set_postfix(loss=f"{float(loss_share) * num_items / items_so_far:.4f}", refresh=False)

    def step_end(self, loss, lr, tokens_per_sec):
        self.tqdm.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_sec:.0f}", refresh=False)

    def close(self):
        """The final bar, once (tqdm's close draws it; later messages go below it)."""
        self.tqdm.close()


class NoBar:
    """The bar train_step advances when it is called without one."""

    def update(self, n=1):
        pass

    def running_loss(self, loss_share, items_so_far, num_items):
        pass


NO_BAR = NoBar()


@contextmanager
def messages_above_bar():
    """Within: Python warnings are written above the progress bar instead of onto its line."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        say(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file or sys.stderr)
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def make_tracker(trainer):
    """The sinks every record goes through (a callback): metrics JSONL, console, TensorBoard, swanlab, wandb.

    A resumed run keeps the records up to its checkpoint's step and continues the same swanlab run; a fresh run
    starts the metrics file anew (kept to step 0)."""
    plan, progress = trainer.plan, trainer.progress
    tracker = Tracker(plan.io.metrics_file, is_main=is_main_process(), tensorboard_dir=plan.io.tensorboard_dir,
                      use_wandb="swanlab" in plan.io.trackers, wandb="wandb" in plan.io.trackers,
                      wandb_project=plan.io.wandb_project, run_name=plan.io.run_name,
                      resume_id=progress.tracker_id, config=dict(plan.flags),
                      resume_step=progress.global_step if trainer.resumed else 0,
                      last_checkpoint=lambda: latest_checkpoint(plan.io.run_dir))
    progress.tracker_id = tracker.run_id
    return tracker


def step_record(trainer, metrics, timer):
    """A step's record: loss summed over ranks, the window's rates, peak memory per rank (collective)."""
    device, counts, progress = trainer.plan.layout.device, trainer.dims.counts_loss, trainer.progress
    names = trainer.objective.stat_names  # the same on every rank, whether or not it computed the loss
    loss, aux_loss, *stat_sums = world_sum([float(v) if counts else 0.0 for v in (
        metrics["ce"], metrics["aux"], *(metrics["stats"].get(n, 0.0) for n in names))], device)
    extra = trainer.objective.record(dict(zip(names, stat_sums)), metrics["num_items"])
    tokens_per_sec, mfu, elapsed = timer.rates()
    memory = per_rank(peak_mem_gb(device), device)
    grad_norm = float(metrics["grad_norm"])  # before clipping; the log step's read (clip: max_norm / (norm + 1e-6))
    return dict(step=progress.global_step, epoch=progress.epoch, loss=loss, aux_loss=aux_loss, lr=metrics["lr"],
                grad_norm=grad_norm, grad_clipped=grad_norm + 1e-6 > trainer.plan.optim.grad_clip,
                tokens=progress.tokens_seen, tokens_per_sec=tokens_per_sec, mfu=mfu, peak_mem_gb=max(memory),
                peak_mem_gb_per_rank=[round(m, 4) for m in memory], elapsed_s=elapsed,
                skipped_steps=trainer.guard.skipped_steps, **extra,
                **({"mfu_provisional": True} if timer.mfu_provisional else {}))  # the CPU peak from busy cores
