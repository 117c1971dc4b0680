"""MiniMind's Logger and a line above the progress bar: what every floor prints."""
import sys

from tqdm import tqdm

from trainer.base import rank_log
from trainer.base.launch import is_main_process


def Logger(content):
    """MiniMind's logger: print on the main process; every rank also writes it to its own log
    (trainer/base/rank_log.py)."""
    rank_log.write(content)
    if is_main_process():
        say(content)


def say(text, file=None):
    """A message on a line of its own, above the progress bar when one is drawn (tqdm.write), flushed at once."""
    file = file or sys.stdout
    tqdm.write(str(text), file=file)
    file.flush()
