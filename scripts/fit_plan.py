"""Will a run fit a named GPU, how long is an epoch, what to change (also `scripts/bench.py --plan --gpu NAME`).

    python scripts/fit_plan.py --gpu 4090 --stage pretrain --hidden_size 768 --num_hidden_layers 16
    python scripts/fit_plan.py --gpu H100 --stage grpo --data_path prompts.jsonl --usd_per_hour 2.5

The estimate, its allowances and its flags: scripts/planner/fit.py; the GPUs: scripts/planner/gpus.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `scripts.` imports

from scripts.planner.fit import main  # noqa: E402

if __name__ == "__main__":
    main()
