"""--profile_steps A:B: a torch.profiler trace of optimizer steps A..B, and the flag's parse.

Imported by the runs that give --profile_steps only: trainer/plan/resolve.py parses the flag (a bad spec is a
ConfigError before training), trainer/core/loop.py builds the StepProfiler.
"""
import torch

from trainer.base.launch import is_main_process
from trainer.base.launch import rank as launch_rank


def parse_profile_steps(spec):
    """'A:B' -> (A, B): the optimizer steps to profile, 1-based and inclusive."""
    message = (f"--profile_steps {spec!r}: give A:B, the first and last optimizer step to profile, "
               "1 <= A <= B (e.g. 5:7)")
    try:
        first, last = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(message) from None
    if not 1 <= first <= last:
        raise ValueError(message)
    return first, last


class StepProfiler:
    """--profile_steps A:B: a torch.profiler trace of optimizer steps A..B (CPU, CUDA on GPU, memory) under out_dir.

    Call `begin(step)` as each optimizer step starts and `close()` when training ends: a step is marked
    `ProfilerStep#<step>` only once it runs, so a run that stops inside A..B leaves no empty mark. Each rank writes
    `rank<r>.<time>.pt.trace.json` (tensorboard_trace_handler): open it in Perfetto or TensorBoard.
    """

    def __init__(self, spec, out_dir, device):
        self.steps = parse_profile_steps(spec) if isinstance(spec, str) else spec  # "A:B", (A, B) or None
        self.out_dir = out_dir
        self.device = torch.device(device)
        self._profiler = self._step_range = None

    def _start(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        rank = launch_rank()
        handler = torch.profiler.tensorboard_trace_handler(self.out_dir, worker_name=f"rank{rank}")
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                                on_trace_ready=handler)
        self._profiler.start()

    def _end_mark(self):
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def begin(self, step):
        """Optimizer step `step` (1-based, global) starts: end the previous step's mark, start or stop the trace."""
        if self.steps is None:
            return
        self._end_mark()
        first, last = self.steps
        if step > last:
            self.close()
        elif step >= first:
            if self._profiler is None:
                self._start()
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_range.__enter__()

    def close(self):
        """End the trace (after the last step, or when training stopped inside A..B) and write it; else a no-op."""
        self._end_mark()
        if self._profiler is None:
            return
        self._profiler.stop()  # writes the trace through on_trace_ready
        self._profiler = None
        if is_main_process():
            print(f"profile of steps {self.steps[0]}..{self.steps[1]} written to {self.out_dir} "
                  "(open the .pt.trace.json in ui.perfetto.dev)", flush=True)
