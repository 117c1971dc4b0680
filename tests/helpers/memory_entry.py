"""A training script whose peak memory of training is measured (CPU): run in its place (python).

MINIMIND_TEST_STAGE names the script (trainer/<name>.py, default train_pretrain); MINIMIND_TEST_MEMORY_OUT the JSON
file written at the end: {"peak_bytes", "allocations"}. Once the data are loaded (interpreter, torch, tokenizer and
datasets are there: what the planner does not count), torch's profiler records every allocation and free of
torch's CPU allocator (profile_memory); peak_bytes is the most bytes of tensors alive at once after that point,
over the model(s), optimizer, rollouts and steps: what torch.cuda.max_memory_allocated() reports on a GPU. It is the
same on every run of the same flags (the ops allocate the same tensors), where the process's resident set moved
~10% with malloc's arenas and what the process had touched before.
"""
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

from trainer.base.launch import main_guard  # noqa: E402


def tensor_peak(profile):
    """(peak bytes, allocations): the running sum of the profiler's CPU memory events, in time order; frees of
    tensors allocated before profiling began are not reported (the profiler does not know their size)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in profile.kineto_results.events()
                    if e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes() != 0)
    alive = peak = 0
    for _, nbytes in events:
        alive += nbytes
        peak = max(peak, alive)
    return peak, sum(1 for _, nbytes in events if nbytes > 0)


def main():
    module = importlib.import_module(f"trainer.{os.environ.get('MINIMIND_TEST_STAGE', 'train_pretrain')}")
    real_load, profile = module.load_datasets, torch.autograd.profiler.profile(profile_memory=True, use_kineto=True)

    def load_datasets(plan):
        datasets = real_load(plan)
        profile.__enter__()
        return datasets
    module.load_datasets = load_datasets
    try:
        module.main()
    finally:
        module.load_datasets = real_load
        profile.__exit__(None, None, None)
    peak, allocations = tensor_peak(profile)
    with open(os.environ["MINIMIND_TEST_MEMORY_OUT"], "w") as f:
        json.dump(dict(peak_bytes=peak, allocations=allocations), f)


if __name__ == "__main__":
    main_guard(main)
