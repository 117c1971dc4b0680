"""MiniMind's small helpers: paths, logging, lr schedule, weight names, the resume sampler (init_model, MiniMind's
model init, is in trainer/ckpt/weights_file.py with the other weights readers)."""
import hashlib
import os
import sys

from torch.utils.data import Sampler
from tqdm import tqdm

from trainer.runtime import rank_log
from trainer.runtime.launch import is_main_process
from trainer.runtime.schedule import MINIMIND_FLOOR, LRSchedule, lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_path(path):
    """A path relative to the repository root (absolute paths pass through): where defaults live."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def typed_or_default(typed, default):
    """The path rule: a path the user typed resolves against the current directory, a default against the repo."""
    if typed is None:
        return None if default is None else repo_path(default)
    return os.path.abspath(typed)


def Logger(content):
    """MiniMind's logger: print on the main process; every rank also writes it to its own log
    (trainer/runtime/rank_log.py)."""
    rank_log.write(content)
    if is_main_process():
        say(content)


def say(text, file=None):
    """A message on a line of its own, above the progress bar when one is drawn (tqdm.write), flushed at once."""
    file = file or sys.stdout
    tqdm.write(str(text), file=file)
    file.flush()


def get_lr(current_step, total_steps, lr, warmup_steps=0):
    """MiniMind's cosine schedule lr*(0.1+0.45*(1+cos(pi*t/T))), after an optional linear warm-up (schedule.py)."""
    return lr_at(LRSchedule("cosine", lr, MINIMIND_FLOOR, warmup_steps, 0.1, 0), current_step, total_steps)


def weight_name(save_weight, config):
    """MiniMind's weight file stem: <save_weight>_<hidden>[_moe]."""
    return f"{save_weight}_{config.hidden_size}{'_moe' if config.use_moe else ''}"


def file_digest(path):
    """' (sha256 <first 12 hex>)' of a weights file, so a run's log names the exact bytes it started from; '' for a
    folder (an HF folder, a checkpoint directory)."""
    if not os.path.isfile(path):
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return f" (sha256 {digest.hexdigest()[:12]})"


class SkipBatchSampler(Sampler):
    """Groups sampler indices into full batches, skipping the first `skip_batches` (for mid-epoch resume)."""

    def __init__(self, sampler, batch_size, skip_batches=0):
        self.sampler, self.batch_size, self.skip_batches = sampler, batch_size, skip_batches

    def __iter__(self):
        batch, seen = [], 0
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                if seen >= self.skip_batches:
                    yield batch
                seen += 1
                batch = []
        # a partial last batch is dropped: every layout then sees the same global batches

    def __len__(self):
        return max(0, len(self.sampler) // self.batch_size - self.skip_batches)
