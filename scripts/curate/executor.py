"""How scripts/curate_data.py runs one stage on datatrove's executors.

- local (default): datatrove's LocalPipelineExecutor with forked workers. datatrove's default start method, a
  forkserver, made every worker run the command script again before its task, and a SIGKILL of the run left the
  forkserver, its resource tracker and a worker running with parent 1. Forked while a stage runs, each child (pool
  worker, datatrove's manager) gets Linux's parent-death signal: it dies with the run. It ignores SIGINT (Ctrl-C
  reaches the run, which ends the pool) and keeps SIGTERM's default (the pool's terminate() ends it).
- ray: datatrove's RayPipelineExecutor on a Ray cluster (`--ray_address`, or a local one of --workers CPUs).
- datatrove's logs (its loguru logger, and whatever else a stage writes to stderr) go to the stage's console.log,
  beside datatrove's per-task logs, unless verbose.
"""
import contextlib
import ctypes
import os
import signal
import sys

from datatrove.executor import LocalPipelineExecutor, RayPipelineExecutor
from datatrove.utils.logging import logger, setup_default_logger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_lifeline = {"parent": None, "prctl": None, "registered": False, "ray_started": False}


class StageFailed(RuntimeError):
    """A stage ended without finishing its tasks, for a reason that is neither bad input nor the disk's."""


def _linux_prctl():
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _after_fork_in_child():
    """In a child forked while a stage runs: die with the parent, leave Ctrl-C to the run."""
    parent = _lifeline["parent"]
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _lifeline["prctl"](PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died between the fork and the line above
        os._exit(1)
    _lifeline["parent"] = os.getpid()  # a child of this child dies with this child


@contextlib.contextmanager
def children_die_with_this_process():
    """While the block runs, every process forked from this one dies when this one does (Linux; elsewhere a no-op)."""
    if not _lifeline["registered"]:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _lifeline["registered"] = True
    _lifeline["prctl"] = _linux_prctl()
    _lifeline["parent"] = os.getpid() if _lifeline["prctl"] else None
    try:
        yield
    finally:
        _lifeline["parent"] = None


@contextlib.contextmanager
def logs_to(path, verbose):
    """datatrove's logs, and anything else written to stderr in the block, appended to `path` (unless verbose)."""
    if verbose:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8", buffering=1) as f:  # line-buffered: forked workers inherit no buffer
        logger.remove()
        logger.add(f, level="INFO")
        try:
            with contextlib.redirect_stderr(f):
                yield
        finally:
            logger.remove()
            setup_default_logger()  # datatrove's own: its logger on stderr


def run_stage(name, pipeline, tasks, workers, logdir, engine="local", verbose=False, ray_address=None):
    """Run `pipeline` as `tasks` tasks (finished ones skipped) on `workers` processes. Bad input (BadRow, a
    ValueError) and OSError come out as they are; any other failure as StageFailed naming the stage's log."""
    log = os.path.join(logdir, "console.log")
    try:
        with logs_to(log, verbose):
            if engine == "ray":
                run_on_ray(pipeline, tasks, workers, logdir, ray_address)
            else:
                with children_die_with_this_process():
                    LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, workers), logging_dir=logdir,
                                          start_method="fork").run()
    except (ValueError, OSError, StageFailed):
        raise
    except Exception as e:
        raise StageFailed(f"stage {name} failed ({type(e).__name__}: {e}); its log: {log}") from e


def run_on_ray(pipeline, tasks, workers, logdir, address):
    """The stage on datatrove's Ray executor; a local Ray instance of `workers` CPUs unless `address` names one."""
    import ray  # optional (requirements-ray.txt): only --executor ray needs it

    if not ray.is_initialized():
        ray.init(address=address, num_cpus=None if address else workers, include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})  # workers import scripts.curate
        _lifeline["ray_started"] = True
    executor = RayPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=logdir, mem_per_cpu_gb=1)
    executor.run()
    failed = executor.get_incomplete_ranks()
    if failed:
        raise StageFailed(f"tasks {failed} did not finish on Ray (datatrove retried each up to 3 times)")


def stop_ray():
    """Shut down the Ray instance run_on_ray connected to, if any."""
    if _lifeline["ray_started"]:
        import ray  # optional, as above

        ray.shutdown()
        _lifeline["ray_started"] = False
