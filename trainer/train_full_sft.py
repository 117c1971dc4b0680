"""MiniMind's name for the SFT stage: `python trainer/train_full_sft.py` (or `cd trainer && python train_full_sft.py`)
runs trainer/train_sft.py's main, the same flags and defaults."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from trainer.base.prelude import loading  # first: a line at once, Ctrl-C during the imports in one line

loading(__name__, "torch, transformers and the trainer")

from trainer.base.launch import main_guard
from trainer.train_sft import main

if __name__ == "__main__":
    main_guard(main)
