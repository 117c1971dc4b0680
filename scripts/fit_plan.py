"""Will a run fit a GPU, how long is an epoch, what to change (also `scripts/bench.py --plan --gpu NAME`).

    python scripts/fit_plan.py --gpu 4090 --stage pretrain --hidden_size 768 --num_hidden_layers 16
    python scripts/fit_plan.py --gpu "RTX 3060" --stage sft --corpus_tokens 2e7
    python scripts/fit_plan.py --gpu_memory_gib 8 --gpu_tflops 40 --stage sft     # a card not in the table
    python scripts/fit_plan.py --gpu H100 --stage grpo --data_path prompts.jsonl --usd_per_hour 2.5

The estimate, its allowances and its flags: scripts/planner/fit.py; the flags' checks: scripts/planner/flags.py; the
GPUs: scripts/planner/gpus.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `scripts.` imports

from scripts.planner.flags import parse_args  # noqa: E402 (argparse and the GPU table: no torch)
from trainer.base.prelude import loaded, loading  # noqa: E402

if __name__ == "__main__":
    parse_args(sys.argv[1:])  # a bad flag or GPU name: one line, exit 2, before torch and the trainer load
    loading(__name__, "torch and the trainer")
    from scripts.planner.fit import main  # noqa: E402 (after the flags' check)
    loaded()
    main()
