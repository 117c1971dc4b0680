"""Where metrics go: the metrics JSONL (always), the console, TensorBoard, swanlab and wandb.

`Tracker.log(record)` writes a record to every sink; the loop reaches it through the callback hooks (on_step_end,
on_eval, on_train_end: trainer/runtime/callbacks.py). Only the main process writes.
swanlab (MiniMind's --use_wandb, or --tracker swanlab) runs online when logged in and offline otherwise, its files
under `<metrics file's folder>/swanlog/` (upload later with `swanlab sync DIR`); never a prompt. wandb (--tracker
wandb, optional) runs offline under `<metrics file's folder>/wandb/` unless WANDB_MODE says otherwise. Both are started
by trainer/observe/dashboards.py, imported by the runs that ask for one only.
"""
import importlib.util
import json
import os
import sys
import threading
from contextlib import contextmanager

from tqdm import tqdm

from model.atomic import full_disk_reason
from model.errors import ConfigError
from trainer.ckpt.storage import DiskFullError

TRACKERS = ("swanlab", "wandb", "tensorboard", "none")

# Console line: (record key, format) in print order; other keys are left to the JSONL and the dashboards.
CONSOLE_FORMATS = [("epoch", "epoch {}"), ("loss", "loss {:.6f}"), ("aux_loss", "aux_loss {:.6f}"),
                   ("lr", "lr {:.3e}"), ("grad_norm", "grad_norm {:.3f}"), ("grad_clipped", "clipped"),
                   ("tokens_per_sec", "tokens/s {:.0f}"), ("mfu", "mfu {:.1%}"),
                   ("mfu_provisional", "mfu peak provisional (CPU measured on busy cores)"),
                   ("peak_mem_gb", "mem {:.2f}GiB"), ("eval_loss", "eval_loss {:.4f}"), ("eval_ppl", "ppl {:.2f}"),
                   ("eval_bpb", "bpb {:.4f}"), ("sample_repeated_4gram", "samples: repeated 4-grams {:.0%}"),
                   ("sample_distinct_2", "distinct-2 {:.2f}"),
                   ("ce", "ce {:.4f}"), ("kl", "kl {:.4f}"), ("rewards/margins", "margin {:.4f}"),
                   ("rewards/accuracies", "acc {:.2f}"), ("reward", "reward {:.4f}"),
                   ("ppo/mean_scores", "reward {:.4f}"),
                   ("completions/mean_length", "len {:.1f}"), ("tokens/responses_len_mean", "len {:.1f}"),
                   ("rollout/time_share", "rollout {:.0%} of the time")]


def truncate_metrics(path, step):
    """Keep only the records with step <= `step` (on resume, so each step is logged once); drops a cut-off last line."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash mid-write
            if isinstance(record, dict) and record.get("step", step + 1) <= step:
                kept.append(json.dumps(record) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of it


@contextmanager
def quiet_full_disk_in_threads():
    """Within: a thread that dies of a full disk (TensorBoard's writer thread) prints nothing; the main thread meets
    the same error (TensorBoard raises it again there) and says it in one line. Other thread errors print as usual."""
    previous = threading.excepthook

    def hook(args):
        if full_disk_reason(args.exc_value) is None:
            previous(args)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def scalars(record):
    """The record's numbers as dashboard scalars: lists become `name/rank0`, `name/rank1`, ...; `step` is the x axis."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, (list, tuple)):
            out.update({f"{key}/rank{i}": float(v) for i, v in enumerate(value)})
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def console_line(record):
    """'step 12 | epoch 0 | loss 8.762530 | ... | mem 0.42GiB': the record's known keys, in a fixed order."""
    parts = [f"step {record['step']}"]
    shown = [(record[key], fmt) for key, fmt in CONSOLE_FORMATS if record.get(key) is not None]
    parts += [fmt.format(value) for value, fmt in shown if value is not False]  # grad_clipped: only when it was
    if record.get("rollout/reused"):  # no generation since the last record: an earlier rollout trained on again
        parts[-1] = "rollout reused"
    return " | ".join(parts)


def resolve_trackers(args, save_dir):
    """(dashboards, TensorBoard folder or None) from --tracker, MiniMind's --use_wandb (swanlab) and --tensorboard_dir;
    ConfigError for an unknown name or a --tracker wandb without the package."""
    names = [name.strip() for name in (args.tracker or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ConfigError(f"--tracker {args.tracker}: {unknown[0]} is not one of {', '.join(TRACKERS)}")
    names += ["swanlab"] * bool(args.use_wandb) + ["tensorboard"] * bool(args.tensorboard_dir)
    names = tuple(dict.fromkeys(name for name in names if name != "none"))
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--tracker wandb needs the wandb package (pip install wandb); or use swanlab or tensorboard")
    typed = os.path.abspath(args.tensorboard_dir) if args.tensorboard_dir else None
    return names, typed or (os.path.join(save_dir, "tensorboard") if "tensorboard" in names else None)


class Tracker:
    """Every enabled sink for the run's records: metrics JSONL (always), console, TensorBoard, swanlab.

    resume_id: the swanlab run id saved in the checkpoint (`.run_id`), so a resumed run continues that run.
    resume_step: the step the run resumes from; later records are dropped from the JSONL and TensorBoard.
    last_checkpoint: () -> the newest complete checkpoint, named in the line of a full disk.
    """

    def __init__(self, metrics_path, *, is_main=True, console=True, tensorboard_dir=None, use_wandb=False,
                 wandb_project="MiniMind", run_name=None, resume_id=None, config=None, resume_step=None, wandb=False,
                 last_checkpoint=None):
        self.run_id, self.last_checkpoint = resume_id, last_checkpoint  # () -> the newest complete checkpoint or None
        self.metrics_path, self.tensorboard_dir = os.path.abspath(metrics_path), tensorboard_dir
        self.is_main = is_main
        self.console = console
        self._file = self._writer = self._swanlab = self._wandb = None
        if not is_main:
            return
        metrics_path, first = self.metrics_path, (resume_step or 0) + 1
        with self._full_disk_as_one_line(metrics_path, first):
            os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
            if resume_step is not None:
                truncate_metrics(metrics_path, resume_step)
            self._file = open(metrics_path, "a")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency: needs the tensorboard package
            purge_step = None if resume_step is None else resume_step + 1  # TensorBoard hides older events from here on
            with self._full_disk_as_one_line(tensorboard_dir, first), quiet_full_disk_in_threads():
                self._writer = SummaryWriter(tensorboard_dir, purge_step=purge_step)
        plain = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                 for k, v in (config or {}).items()}
        if use_wandb or wandb:
            from trainer.observe import dashboards  # swanlab's and wandb's runs: read by the runs that ask for one only
        if use_wandb:  # MiniMind's flag name: swanlab
            self._swanlab = dashboards.start_swanlab(wandb_project, run_name, resume_id, plain,
                                          os.path.join(os.path.dirname(metrics_path), "swanlog"))
            if self._swanlab is not None:
                self.run_id = self._swanlab.id
        if wandb:  # the same run id as swanlab's when both run
            self._wandb = dashboards.start_wandb(wandb_project, run_name, self.run_id, plain,
                                      os.path.dirname(metrics_path))
            self.run_id = self.run_id or self._wandb.id

    def log(self, record):
        """Write one record (it has "step") to every enabled sink; the JSONL line is flushed before returning.

        A full disk under the JSONL or TensorBoard files stops the run with one line (DiskFullError, exit 3): the
        resume drops a line cut short and every record past its checkpoint, so nothing is logged twice or lost."""
        if not self.is_main:
            return
        with self._full_disk_as_one_line(self.metrics_path, record["step"]):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.console:
            tqdm.write(console_line(record))  # keeps a tqdm progress bar intact
            sys.stdout.flush()
        values = scalars(record)
        if self._writer is not None:
            with self._full_disk_as_one_line(self.tensorboard_dir, record["step"]), quiet_full_disk_in_threads():
                for name, value in values.items():
                    self._writer.add_scalar(name, value, record["step"])
                self._writer.flush()
        if self._swanlab is not None:
            self._swanlab.log(values, step=record["step"])
        if self._wandb is not None:
            self._wandb.log(values, step=record["step"])

    @contextmanager
    def _full_disk_as_one_line(self, where, step):
        """An OSError of a full disk inside the block: the files are dropped and DiskFullError names `where`."""
        try:
            yield
        except OSError as e:
            reason = full_disk_reason(e)
            if reason is None:
                raise
            self._drop_files()
            last = self.last_checkpoint() if self.last_checkpoint else None
            then = (f"the last complete checkpoint is {last}; free space, then resume with --from_resume 1" if last
                    else "no complete checkpoint yet; free space, then run again")
            error = DiskFullError(f"disk full: cannot write the metrics of step {step} to {where} ({reason}); "
                                  f"{then}")
            error.every_rank = True  # rank 0's alone: it says it, the others stop on the lost peer
            raise error from None

    def _drop_files(self):
        """Close the JSONL and TensorBoard files after a failed write, quietly (their buffers cannot be written)."""
        for sink in (self._file, self._writer):
            try:
                if sink is not None:
                    sink.close()
            except OSError:
                pass
        self._file = self._writer = None

    def on_step_end(self, trainer, record):
        """The callback hooks (trainer/runtime/callbacks.py): log records, close at the end."""
        if record is not None:
            self.log(record)

    def on_eval(self, trainer, record):
        self.log(record)

    def on_train_end(self, trainer):
        self.close()

    def close(self):
        """Flush and close every sink (safe to call twice)."""
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._swanlab is not None:
            self._swanlab.finish()
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._writer = self._swanlab = self._wandb = None
