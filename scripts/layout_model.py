"""docs/scaling.md's tables: memory per rank and communication per step of 3 models x layouts on 8 and 64 GPUs.

    python scripts/layout_model.py                                             # docs/scaling.md's tables
    python scripts/bench.py --plan --nproc 64 --tp 4 --pp 4 --hidden_size 2048 --num_hidden_layers 32  # one layout

The layout model is scripts/planner/cost.py, the tables scripts/planner/scaling.py (formulas: docs/scaling.md).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `scripts.` imports
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch and the trainer's plan")

from scripts.planner.scaling import plan_table  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

if __name__ == "__main__":
    print(plan_table())
