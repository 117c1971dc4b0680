"""The process lifecycle: process group, seeds, ranks, the small collectives, and main_guard (errors -> one line and
an exit code; the errors themselves in trainer/base/errors.py)."""
import atexit
import os
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from dataset.cache_guard import CacheBuildInterrupted
from model.errors import ConfigError
from model.torch_compat import set_default_pg_timeout
from trainer.base import rank_log
from trainer.base.errors import SignalStop, TrainingHalted
from trainer.base.streams import survive_closed_output, write_fd

RANK0_REPORT_SECONDS = 2


# what a signal outside the loop's own handler stops (the loop sets it once it has run)
BEFORE_THE_LOOP = "before the first optimizer step; nothing was saved"
OUTSIDE_LOOP = {"when": BEFORE_THE_LOOP}
SAVED = {"path": None}  # the newest checkpoint this process saw complete (the Checkpointer sets it)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def saved_line():
    """What a rank that stops knows of the checkpoints: the newest complete one it saw, or that it saw none."""
    path = SAVED["path"]
    return f"{path} is saved; continue with --from_resume 1" if path else "this run saved no checkpoint"


def stop_on_signals():
    """Until the loop installs its own (trainer/runtime/signals.py Preemption): SIGINT/SIGTERM raise SignalStop, which
    main_guard turns into one line and exit 130/143 instead of a traceback (SIGINT) or a silent death (SIGTERM).

    Once: the handler hands the signals to leave_on_signals before it raises, so a later one ends the process with
    the first one's line and code and never raises again inside the code that reports the first. Raised where Python
    cannot pass it on (a __del__, a weakref or atexit callback prints "Exception ignored" and goes on), the
    SignalStop ends the process there, with its line (stopped_where_unraisable)."""
    OUTSIDE_LOOP["when"], SAVED["path"] = BEFORE_THE_LOOP, None  # a new run in this process (tests run main())
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        when = OUTSIDE_LOOP["when"]
        if when == BEFORE_THE_LOOP and SAVED["path"]:  # the loop left early (an error) after a save
            when = f"outside the training loop; {saved_line()}"
        line = f"{signal.Signals(signum).name}: stopped {when}"
        leave_on_signals(128 + signum, line)
        raise SignalStop(signum, line)
    for sig in SIGNALS:
        signal.signal(sig, handle)
    sys.unraisablehook = stopped_where_unraisable


def stopped_where_unraisable(unraisable):
    """sys.unraisablehook while main_guard runs: a SignalStop ends the process (its line, its code); any other
    exception is printed as Python prints it."""
    stop = unraisable.exc_value
    if isinstance(stop, SignalStop):
        leave_now(128 + stop.signum, stop.message)
    sys.__unraisablehook__(unraisable)


def rank():
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_main_process():
    return rank() == 0


def local_shard(t):
    """This rank's plain tensor of a DTensor (its shard), or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_value(t):
    """A detached plain tensor of a replicated value (a DTensor loss under tensor parallel): its full value, no
    communication; `t` itself, detached, otherwise."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def add_stats(total, stats):
    """Sum an objective's per-micro-batch stats (tensors, detached here) into `total`, name by name."""
    for name, value in stats.items():
        total[name] = total.get(name, 0.0) + full_value(value)
    return total


def backend_for(device):
    """The process group's backend for the plan's device: NCCL moves CUDA tensors, gloo CPU ones. The device decides,
    not the host: `--device cpu` on a GPU host must not put CPU tensors through NCCL."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed_mode(device="cpu", timeout_s=1800):
    """Start the process group under torchrun for `device`; return the local rank (0 without torchrun).

    On CUDA each rank takes cuda:<local rank> (device_id binds the NCCL group to it) and a gloo group beside it
    carries the small CPU collectives (token counts), which then never wait for the GPU. `timeout_s` covers start-up
    up to the end of the first step; set_collective_timeout shortens it once training runs."""
    global CPU_GROUP
    if int(os.environ.get("RANK", -1)) == -1:
        return 0
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = backend_for(device)
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", local_rank)
        torch.cuda.set_device(device_id)
    timeout = timedelta(seconds=timeout_s)
    store, rank_, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun --max-restarts keeps its store across restarts: without a per-attempt prefix a restarted rank can read
    # a dead worker's address from the last attempt and fail in "Gloo connectFullMesh ... Connection refused"
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world_size, timeout=timeout,
                            device_id=device_id)
    CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return local_rank


CPU_GROUP = None  # the gloo group beside NCCL (None: the default group is gloo already)


def set_collective_timeout(seconds):
    """After the first step: a hung collective of the default group fails after `seconds` (torchtitan's
    train_timeout_seconds); the start-up timeout had to cover the token cache, weights and compile."""
    if dist.is_initialized():
        set_default_pg_timeout(seconds)


def setup_seed(seed, deterministic=False):
    """Seed every RNG; `deterministic` (--deterministic 1): deterministic kernels only, no cuDNN autotuning."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True


def world_sum(values, device):
    """Sum a list of floats over all ranks (ranks that should not count pass zeros)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def count_sum(value, replicas=1):
    """Sum an int (or a list of ints) held on every rank over all ranks, on the CPU (no device sync); `replicas`:
    how many ranks hold the same value of one data-parallel rank (Layout.copies_of_data): the result sums over dp."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if dist.is_initialized():
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, group=CPU_GROUP)
        values = [int(v) // replicas for v in t.tolist()]
    return values if isinstance(value, (list, tuple)) else values[0]


def per_rank(value, device):
    """One float from every rank, in rank order (e.g. each rank's peak memory)."""
    if not dist.is_initialized():
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return [g.item() for g in gathered]


# a collective's error when a peer process has gone (gloo's words); the rank that left says why in its own line
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def main_guard(main):
    """Run main() and end the process: a ConfigError becomes one line on stderr and exit code 2 on every rank, a
    TrainingHalted (the run stopped itself) one line and exit code 3, a signal (SignalStop) its line and exit
    128 + signum, wherever it lands (main(), the report of how main() ended, its first or a second signal); console
    output survives a reader that left (trainer/base/streams.py). Once the code is known a signal ends the rank with it
    and no more words (leave_on_signals), through the exit (atexit, finalization) too."""
    survive_closed_output()
    try:
        stop_on_signals()  # inside the try: a signal from the moment the handlers are in place is reported
        code = run_and_report(main)
    except SignalStop as e:  # came while main()'s end was reported; the handler raises once, so not again here
        code = report_stop(e.__context__ if isinstance(e.__context__, SignalStop) else e)
    if int(os.environ.get("RANK", -1)) != -1:  # a torchrun worker
        leave_without_finalizing(code)
    sys.exit(code)


def run_and_report(main):
    """main() and the report of how it ended; the exit code. Every way out hands the signals to leave_on_signals
    first, so that none raises in the code after it."""
    try:
        main()
    except SignalStop as e:
        return report_stop(e)
    except (ConfigError, TrainingHalted, CacheBuildInterrupted) as e:
        code = 2 if isinstance(e, ConfigError) else 3 if isinstance(e, TrainingHalted) else 128 + e.signum
        leave_on_signals(code)
        report_error(e)
        return code
    except RuntimeError as e:
        rank_log.write(f"error:\n{traceback.format_exc()}")
        if not (dist.is_initialized() and any(m in str(e) for m in PEER_LOST)):
            raise
        leave_on_signals(1)
        report_lost_peer(e)
        return 1
    except BaseException:
        rank_log.write(f"error:\n{traceback.format_exc()}")
        raise
    leave_on_signals(0)
    return 0


def report_stop(e):
    """A SignalStop's exit code, after its line (rank 0; None: the loop said it already, after saving)."""
    code = 128 + e.signum
    leave_on_signals(code)  # before the line: a second signal ends the rank with this code, and never twice the line
    if e.message:
        rank_log.write(e.message)
        if int(os.environ.get("RANK", 0)) == 0:
            print(e.message, file=sys.stderr, flush=True)
    return code


def report_error(e):
    """A ConfigError, TrainingHalted or interrupted cache build: its one line (rank 0, or the rank it belongs to),
    then this rank leaves the process group."""
    rank_log.write(f"error: {e}")
    own = getattr(e, "every_rank", False)  # an error of this rank alone (out of memory): it says it
    if int(os.environ.get("RANK", 0)) == 0 or own:
        print(f"error: {e}", file=sys.stderr, flush=True)
    elif not dist.is_initialized():
        # torchrun stops every worker as soon as one exits: let rank 0, which ran the same checks, say it first
        time.sleep(RANK0_REPORT_SECONDS)
    if dist.is_initialized() and not own:  # the others may sit in a collective this rank will never join
        dist.destroy_process_group()


def report_lost_peer(e):
    """Another rank left (its own error line says why): one line here, with what this rank knows was saved; its exit
    is the launcher's first."""
    reason = str(e).splitlines()[0][:160]  # the head says what failed; a long line's tail is an address
    print(f"stopped: rank {os.environ.get('RANK', 0)} lost a peer in a collective ({reason}); {saved_line()}",
          file=sys.stderr, flush=True)
    time.sleep(RANK0_REPORT_SECONDS)


def leave_on_signals(code, line=None):
    """From here this rank only reports and leaves: SIGINT/SIGTERM (torchrun stopping the ranks once one left, or a
    second Ctrl-C) end it at once with `code`, silently, or after `line` (a stop's own that is not said yet), instead
    of raising inside the report (a traceback)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame):
        leave_now(code, line)
    for sig in SIGNALS:
        signal.signal(sig, leave)


def leave_now(code, line=None):
    """End this rank at once with `code`, after `line` (rank 0) straight to stderr's descriptor: a signal handler may
    run inside a write to the same stream, whose buffer then refuses a second one."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (RuntimeError, OSError, ValueError):
            pass  # reentrant, or closed: what it held is lost, the exit is not
    if line and int(os.environ.get("RANK", 0)) == 0:
        write_fd(2, f"{line}\n")
    os._exit(code)


def leave_without_finalizing(code):
    """Exit a torchrun worker with `code`, skipping interpreter finalization (docs/design.md, Decisions).

    A gloo worker thread may free a finished collective's tensors after finalization began and abort the process;
    everything is written and closed by now, so run the atexit handlers, flush and leave."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
