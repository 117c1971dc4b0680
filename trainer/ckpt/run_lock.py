"""One run per checkpoint directory, and nothing finished destroyed (claim_run, called before the model is built).

A run whose name has checkpoints or weights already, started without --from_resume, would replace them at its first
save: it is refused in one line unless --overwrite 1 says start over. Rank 0 then holds <run_dir>/run.lock (its
host and pid) for the run's life: a second run on the directory is refused naming them; the lock of a run that died
on this host (its pid gone) is taken over with a note. Rank 0 decides, every rank hears it (a collective).
"""
import atexit
import json
import os
import shutil
import socket
import time

from model.errors import ConfigError
from trainer.base.launch import rank
from trainer.base.log import Logger
from trainer.ckpt.step_dirs import BEST_INDEX, checkpoints, latest_checkpoint, minimind_resume_path
from trainer.ckpt.storage import from_rank0

LOCK = "run.lock"


def _replaced_weights(plan):
    """The weights file a fresh start would replace, or None; a run that starts from that very file (--from_weight
    of its own name: DPO's second round) takes it as its input."""
    weights = plan.stage.weights_path(plan)
    starts_from = plan.model.from_weight != "none" and os.path.abspath(plan.model.from_weight) == \
        os.path.abspath(weights)
    return weights if os.path.isfile(weights) and not starts_from else None


def earlier_output(plan, with_checkpoints=True):
    """What a fresh start of this run would replace: its complete checkpoints and its weights (phrases)."""
    found = []
    steps = [step for step, _, done in checkpoints(plan.io.run_dir) if done] if with_checkpoints else []
    if steps:
        found.append(f"checkpoints of steps {steps[0]}..{steps[-1]} in {plan.io.run_dir}" if len(steps) > 1 else
                     f"the checkpoint of step {steps[0]} in {plan.io.run_dir}")
    if _replaced_weights(plan):
        found.append(f"weights {_replaced_weights(plan)}")
    return found


def overwrite_line(plan):
    """The refusal of a run that would replace an earlier run's checkpoints or weights, else None."""
    io = plan.io
    if io.overwrite:
        return None if io.from_resume == "0" else (
            f"--overwrite 1 starts over, --from_resume {io.resume_path or io.from_resume} continues: pass one of them")
    resumable = latest_checkpoint(io.run_dir) or os.path.isfile(minimind_resume_path(io.checkpoint_dir, io.run_name))
    if io.from_resume == "1" or (io.from_resume == "auto" and resumable):
        return None  # it continues them (read_resume refuses --from_resume 1 without a checkpoint)
    found = earlier_output(plan, with_checkpoints=io.from_resume == "0")
    if not found:
        return None
    return (f"run {io.run_name} exists: {' and '.join(found)}; pass --from_resume 1 to continue it, or --overwrite 1 "
            "to start over (they are replaced), or choose another --save_weight or --checkpoint_dir")


def _holder(path):
    """The lock's {"host", "pid", "started"}, or None when it is gone or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def take_lock(run_dir):
    """Hold <run_dir>/run.lock for this process (released at exit); the refusal line when a live run holds it."""
    os.makedirs(run_dir, exist_ok=True)
    path, me = os.path.join(run_dir, LOCK), dict(host=socket.gethostname(), pid=os.getpid())
    for _ in range(3):  # a stale lock removed, or one released meanwhile: try again
        draft = f"{path}.{me['pid']}.tmp"
        with open(draft, "w") as f:
            json.dump(dict(me, started=time.strftime("%Y-%m-%d %H:%M:%S")), f)
        try:
            os.link(draft, path)  # atomic, and fails when the lock exists: never a half-written lock
            atexit.register(release_lock, path)
            return None
        except FileExistsError:
            holder = _holder(path)
        finally:
            os.remove(draft)
        if holder is None:
            continue
        if (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"]):
            return None  # this process holds it already (a second trainer in one process)
        if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
            Logger(f"note: taking over {path} of run pid {holder['pid']} on {holder['host']}, which is no longer "
                   "running")
            _remove(path)
            continue
        return (f"{run_dir} is in use by another run (host {holder.get('host')}, pid {holder.get('pid')}, started "
                f"{holder.get('started')}); wait for it to end or choose another --save_weight or --checkpoint_dir "
                f"(if that run is gone, delete {path})")
    return f"{path} is contended by several runs starting at once; start one run per directory"


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def release_lock(path):
    """Remove the lock if this process still holds it."""
    holder = _holder(path)
    if holder and (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid()):
        _remove(path)


def start_over(run_dir):
    """--overwrite 1: drop the earlier run's checkpoints now, so that no later resume mixes the two runs."""
    removed = [path for _, path, _ in checkpoints(run_dir)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(os.path.join(run_dir, BEST_INDEX)):
        os.remove(os.path.join(run_dir, BEST_INDEX))
    if removed:
        Logger(f"--overwrite 1: removed the earlier run's {len(removed)} checkpoint(s) in {run_dir}; starting over")


def claim_run(plan):
    """Refuse a run that would replace an earlier one's results, or that a live run holds the directory of; else hold
    the directory's lock (rank 0) for the run's life. A collective: every rank raises the same ConfigError."""
    line = None
    if rank() == 0:
        line = overwrite_line(plan) or take_lock(plan.io.run_dir)
        if line is None and plan.io.overwrite:
            start_over(plan.io.run_dir)
    line = from_rank0(line)
    if line:
        raise ConfigError(line)

