"""A training script whose peak memory of training is measured (CPU, Linux): run in its place (python).

MINIMIND_TEST_STAGE names the script (trainer/<name>.py, default train_pretrain); MINIMIND_TEST_MEMORY_OUT the JSON
file written at the end: {"baseline_bytes", "peak_bytes"}. Once the data are loaded (interpreter, torch, tokenizer
and datasets are there: what the planner does not count), the kernel's peak resident set is reset
(/proc/self/clear_refs 5) and the resident set read; peak_bytes is the peak resident set after, over the model(s),
optimizer, rollouts and steps.
"""
import gc
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from trainer.base.launch import main_guard  # noqa: E402
from trainer.runtime.metrics import trim_heap  # noqa: E402


def status_bytes(field):
    """VmRSS / VmHWM of this process in bytes (/proc/self/status gives kB)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def main():
    module = importlib.import_module(f"trainer.{os.environ.get('MINIMIND_TEST_STAGE', 'train_pretrain')}")
    real_load, baseline = module.load_datasets, {}

    def load_datasets(plan):
        datasets = real_load(plan)
        gc.collect()
        trim_heap("cpu")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS from here
        baseline["bytes"] = status_bytes("VmRSS")
        return datasets
    module.load_datasets = load_datasets
    try:
        module.main()
    finally:
        module.load_datasets = real_load
    with open(os.environ["MINIMIND_TEST_MEMORY_OUT"], "w") as f:
        json.dump(dict(baseline_bytes=baseline["bytes"], peak_bytes=status_bytes("VmHWM")), f)


if __name__ == "__main__":
    main_guard(main)
