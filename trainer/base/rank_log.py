"""Each rank's own log, <log_dir>/<run>_rank_<N>.log (default <save_dir>/logs; <run> the weight stem, so runs that
share a save_dir keep their own logs): timestamped lines of what the run says
(every Logger line, on every rank, though only rank 0 prints it), this rank's view of each logged step (its peak
memory, its share of the step), saves, and the error or traceback that ended it. Appended: a resumed run adds a
header and goes on in the same file. Only rank 0 prints to the console; this is where the other ranks speak.
"""
import json
import os
import socket
import time

import torch.distributed as dist

_LOG = None  # this process's open log file, or None (off, or not started yet)


def rank_now():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def open_rank_log(log_dir, run_name, header):
    """Start (or go on with) this rank's log of run `run_name` in `log_dir`; None turns it off."""
    global _LOG
    close_rank_log()
    if log_dir is None:
        return None
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"{run_name}_rank_{rank_now()}.log")
    _LOG = open(path, "a", buffering=1)  # line-buffered: a killed rank's last lines are on disk
    write(f"start: {header} (host {socket.gethostname()}, pid {os.getpid()})")
    return path


def write(text):
    """Timestamped lines of `text` in this rank's log (nothing when it is off)."""
    if _LOG is None:
        return
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    _LOG.write("".join(f"{stamp} {line}\n" for line in str(text).splitlines() or [""]))


def close_rank_log():
    global _LOG
    if _LOG is not None:
        _LOG.close()
        _LOG = None


class RankLog:
    """The callback that writes this rank's view of each logged step, eval and save into its log."""

    def on_step_end(self, trainer, record):
        if record is not None:  # the record (summed over ranks) and this rank's own loss share and peak memory
            mine = dict(loss=trainer.guard.last_loss, peak_mem_gb=record["peak_mem_gb_per_rank"][rank_now()])
            write(f"step {record['step']}: {json.dumps(dict(record, this_rank=mine))}")

    def on_eval(self, trainer, record):
        write(f"eval: {json.dumps(record)}")

    def on_save(self, trainer, step):
        write(f"saved the checkpoint of step {step}")

    def on_train_end(self, trainer):
        write(f"done at step {trainer.progress.global_step}")
