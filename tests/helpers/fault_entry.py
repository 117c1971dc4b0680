"""A training script with faults injected from outside: the trainer itself has no test hooks.

Run in its place (python or torchrun); MINIMIND_TEST_STAGE names the script (trainer/<name>.py, default
train_pretrain); the environment says which fault, on torchrun's first attempt only:
  MINIMIND_TEST_KILL_AT_STEP=N     SIGKILL rank MINIMIND_TEST_KILL_RANK (default 0) at step N: after the step's
                                   logging and saving (MINIMIND_TEST_KILL_POINT=step, the default), or inside its
                                   save once the shards are written or the async write is in flight (=save)
  MINIMIND_TEST_CORRUPT_REPLICA=<rank>:<step>:<name>   add 1 to one value of that parameter on that rank just
                                   before the replica check of that step
  MINIMIND_TEST_FILL_DISK=<step>:<file>   after that step, write <file> until its disk is full (a full disk from then)
  MINIMIND_TEST_REPORT_SECONDS=S  main_guard's report window (RANK0_REPORT_SECONDS: a rank that refuses or lost a
                                   peer waits so rank 0 speaks first): a long one puts torchrun's SIGTERM to the other
                                   ranks inside it on every run, not by chance (every attempt)
  MINIMIND_TEST_REPORT_AFTER_ALL=<dir>  rank 0 reports its error (main_guard's report_error) only once every other
                                   rank has entered its own report (each marks <dir>/rank_<r>), so that torchrun's
                                   SIGTERM after rank 0's exit finds every other rank inside its report window
  MINIMIND_TEST_OOM_AT_STEP=N      rank MINIMIND_TEST_OOM_RANK (default 0) asks the allocator for 2**62 bytes in the
                                   forward of step N's first micro-batch: a real allocation failure
  MINIMIND_TEST_SIGTERM_IN_REPORT=1  a rank SIGTERMs itself as main_guard begins the report of an error main() raised
                                   (its traceback to the rank log): torchrun's SIGTERM after a lost peer lands there
                                   on every run, not by chance
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import importlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from trainer.base import launch, rank_log  # noqa: E402
from trainer.base.launch import main_guard, rank  # noqa: E402
from trainer.core import loop as train_loop  # noqa: E402
from trainer.parallel import data as data_parallel  # noqa: E402
from trainer.plan.objective import LMObjective  # noqa: E402

STAGE = "MINIMIND_TEST_STAGE"
KILL_AT_STEP = "MINIMIND_TEST_KILL_AT_STEP"
CORRUPT_REPLICA = "MINIMIND_TEST_CORRUPT_REPLICA"


def kill_at(step, victim):
    """SIGKILL this process when it is rank `victim` at `step`."""
    if rank() == victim:
        print(f"fault_entry: SIGKILL rank {victim} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def patch_kill(step, point, victim):
    if point == "step":
        real_after_step = train_loop.after_step

        def after_step(trainer, *args, **kwargs):
            real_after_step(trainer, *args, **kwargs)
            if trainer.progress.global_step == step:
                kill_at(step, victim)
        train_loop.after_step = after_step
        return
    for name in ("save", "async_save"):  # the Checkpointer calls dcp.<name>, then writes the manifest

        def saving(*args, _real=getattr(dcp, name), **kwargs):
            result = _real(*args, **kwargs)
            if os.path.basename(str(kwargs["checkpoint_id"])) == f"step_{step}":
                kill_at(step, victim)
            return result
        setattr(dcp, name, saving)


def patch_corrupt(spec):
    victim, at_step, target = spec.split(":", 2)
    real_check = data_parallel.check_replicas  # the dp module's, which the loop calls

    def check_replicas(model_parts, group, step):
        if dist.get_rank() == int(victim) and step == int(at_step):
            for part in model_parts:
                for name, param in part.named_parameters():
                    if name.replace("module.", "") == target:
                        with torch.no_grad():
                            param.view(-1)[0] += 1.0
        return real_check(model_parts, group, step)
    data_parallel.check_replicas = check_replicas


def patch_fill_disk(spec):
    at_step, path = spec.split(":", 1)
    real_after_step = train_loop.after_step

    def after_step(trainer, *args, **kwargs):
        real_after_step(trainer, *args, **kwargs)
        if trainer.progress.global_step == int(at_step):
            with open(path, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass  # full
            print(f"fault_entry: filled the disk of {path} after step {at_step}", flush=True)
    train_loop.after_step = after_step
def patch_out_of_memory(step, victim):
    real_loss = LMObjective.loss

    def loss(self, model, *args, **kwargs):
        if rank() == victim and steps_started[0] == step:
            torch.empty(2 ** 62, dtype=torch.uint8)  # what a too-large batch meets: the allocator refuses
        return real_loss(self, model, *args, **kwargs)
    real_train_step, steps_started = train_loop.train_step, [0]

    def train_step(trainer, *args, **kwargs):
        steps_started[0] = trainer.progress.global_step + 1
        return real_train_step(trainer, *args, **kwargs)
    LMObjective.loss, train_loop.train_step = loss, train_step


def patch_report_after_all(marks):
    """Rank 0's report_error waits (up to 120 s) for every other rank's mark; the others mark, then report."""
    real_report, me, world = launch.report_error, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def report_error(e):
        if me:
            open(os.path.join(marks, f"rank_{me}"), "w").close()
        deadline = time.time() + 120
        while me == 0 and len(os.listdir(marks)) < world - 1 and time.time() < deadline:
            time.sleep(0.05)
        real_report(e)
    launch.report_error = report_error


def patch_sigterm_in_report():
    real_write = rank_log.write

    def write(text):
        if text.startswith("error:\n"):  # main_guard's report of an error, first thing
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before os.kill returns
        real_write(text)
    rank_log.write = write


def main():
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ.get(KILL_AT_STEP) and first_attempt:
        patch_kill(int(os.environ[KILL_AT_STEP]), os.environ.get("MINIMIND_TEST_KILL_POINT", "step"),
                   int(os.environ.get("MINIMIND_TEST_KILL_RANK", 0)))
    if os.environ.get(CORRUPT_REPLICA) and first_attempt:
        patch_corrupt(os.environ[CORRUPT_REPLICA])
    if os.environ.get("MINIMIND_TEST_FILL_DISK") and first_attempt:
        patch_fill_disk(os.environ["MINIMIND_TEST_FILL_DISK"])
    if os.environ.get("MINIMIND_TEST_REPORT_AFTER_ALL"):
        patch_report_after_all(os.environ["MINIMIND_TEST_REPORT_AFTER_ALL"])
    if os.environ.get("MINIMIND_TEST_REPORT_SECONDS"):
        launch.RANK0_REPORT_SECONDS = float(os.environ["MINIMIND_TEST_REPORT_SECONDS"])
    if os.environ.get("MINIMIND_TEST_OOM_AT_STEP"):
        patch_out_of_memory(int(os.environ["MINIMIND_TEST_OOM_AT_STEP"]),
                            int(os.environ.get("MINIMIND_TEST_OOM_RANK", 0)))
    if os.environ.get("MINIMIND_TEST_SIGTERM_IN_REPORT"):
        patch_sigterm_in_report()
    importlib.import_module(f"trainer.{os.environ.get(STAGE, 'train_pretrain')}").main()


if __name__ == "__main__":
    main_guard(main)
