"""Out of memory during training, on any rank: one `error:` line from that rank with the step, its peak memory and what
to change, then the rank leaves (exit 3) and torchrun stops the others; checkpoints are only ever complete or ignored,
so the last complete one stays usable. CPU: MemoryError or the allocator's RuntimeError; CUDA:
torch.cuda.OutOfMemoryError."""
import re
from contextlib import contextmanager

import torch

from trainer.base.errors import TrainingHalted
from trainer.base.launch import rank
from trainer.ckpt.step_dirs import latest_checkpoint
from trainer.observe.metrics import peak_mem_gb

CPU_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")


class OutOfMemory(TrainingHalted):
    """An allocation failed: said by the rank it failed on (the others may be waiting in a collective)."""
    every_rank = True


def is_out_of_memory(error):
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in CPU_MESSAGES)


def advice(plan):
    """What to change, most direct first, for this run's layout."""
    changes = [f"lower --batch_size (now {plan.data.micro_batch}; raise --accumulation_steps to keep the global batch)"]
    if plan.model.grad_checkpointing != "full":
        changes.append("--grad_checkpointing full")
    if plan.layout.dp * plan.layout.cp > 1 and plan.layout.zero_stage < 3:
        changes.append(f"--zero_stage {plan.layout.zero_stage + 1} (shards more state over the data-parallel ranks)")
    if plan.layout.dp_mode == "fsdp2" and plan.layout.device.startswith("cuda") and not plan.layout.cpu_offload:
        changes.append("--cpu_offload 1")
    if not plan.model.chunked_loss and plan.layout.tp == 1 and plan.layout.pp == 1:
        changes.append("--loss_chunk_size 1024")
    return ", ".join(changes[:-1]) + f" or {changes[-1]}" if len(changes) > 1 else changes[0]


def what_failed(error):
    """The allocator's words, without the C++ source location: "DefaultCPUAllocator: can't allocate memory: ..."."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", first)[:200]


@contextmanager
def out_of_memory_as_one_line(trainer):
    """Around the loop: an allocation failure becomes OutOfMemory with the line that says what to do."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        plan, progress = trainer.plan, trainer.progress
        kind = "CUDA" if isinstance(e, torch.cuda.OutOfMemoryError) else "CPU"
        last, peak = latest_checkpoint(plan.io.run_dir), peak_mem_gb(plan.layout.device)
        raise OutOfMemory(
            f"out of {kind} memory on rank {rank()} in step {progress.global_step + 1} (peak {peak:.2f} GiB on this "
            f"rank; {what_failed(e)}): {advice(plan)}; the last complete checkpoint is "
            f"{last or 'none yet'}" + (", continue with --from_resume 1" if last else "")) from None
