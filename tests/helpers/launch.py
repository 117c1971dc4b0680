"""Launch real multi-process (gloo, CPU) jobs from tests, always with a timeout."""
import atexit
import gc
import importlib
import json
import logging
import multiprocessing
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataset.demo_data import ensure_demo_data
from trainer.base.launch import main_guard
from trainer.observe import metrics
from trainer.parallel.pipeline import make_schedule, split_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, error_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size, *args, timeout=120, start_method="spawn"):
    """Run fn(rank, world_size, *args) in world_size processes with a gloo group; raise on any failure.

    fn must be a module-level function. Ranks that fail write their traceback, which is re-raised here.
    start_method "fork" starts the ranks with this process's imports done (~8 s of CPU less per rank, CPU only).
    """
    error_dir = tempfile.mkdtemp()
    ctx = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, error_dir),
                             nprocs=world_size, join=False, start_method=start_method)
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.time())):
            if time.time() > deadline:
                raise TimeoutError(f"distributed job did not finish within {timeout}s")
    except Exception as e:
        errors = [open(os.path.join(error_dir, f)).read() for f in sorted(os.listdir(error_dir))]
        raise RuntimeError("\n".join(errors) or str(e)) from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        shutil.rmtree(error_dir, ignore_errors=True)


def torchrun(script, nproc, args, timeout=300, env=None, launcher_args=()):
    """Run `torchrun --nproc_per_node nproc [launcher_args] script args` on CPU; return CompletedProcess (never
    hangs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *launcher_args, os.path.join(ROOT, script), *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def python(script, args, timeout=300, env=None, cwd=ROOT):
    """Run `python script args` in one process (in `cwd`, default the repo root); return CompletedProcess."""
    cmd = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


def _run_forked_script(path, args, env, cwd, out_path, err_path, in_path):
    """The body of one forked process: `python path args` as __main__, its output appended to the two files."""
    code = 1
    try:
        out, err, stdin = open(out_path, "a", buffering=1), open(err_path, "a", buffering=1), open(in_path)
        for stream, fd in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(stream.fileno(), fd)
        sys.stdin, sys.stdout, sys.stderr = stdin, out, err
        atexit._clear()  # the test process's exit handlers are not this run's
        logging.root.handlers.clear()  # pytest's capturing handler lives in the test process
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.set_num_threads(1)
        sys.argv = [path, *map(str, args)]
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait_ranks(processes, timeout, grace=10):
    """Join the ranks; the first failing rank's exit code (0 if none). Once one fails, the others get `grace`
    seconds to leave before they are killed, as torchrun's agent would stop them."""
    deadline, first_failure, failed_at = time.time() + timeout, 0, None
    while any(p.is_alive() for p in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if failed and failed_at is None:
            first_failure, failed_at = failed[0], time.time()
        if time.time() > deadline:
            raise subprocess.TimeoutExpired([p.name for p in processes], timeout)
        if failed_at is not None and time.time() > failed_at + grace:
            for p in processes:
                p.kill()
        time.sleep(0.05)
    return first_failure or next((p.exitcode for p in processes if p.exitcode != 0), 0)


def share_cpu_peak():
    """The CPU matmul rates the trainer's MFU is against (trainer/observe/metrics.py), measured once in this process
    with one thread, as the ranks run: forked processes inherit them. Each rank measured them itself before (1-3 s of
    matmuls, one rank after another under a lock) whenever the cores were busy, as they are during a test run; a
    provisional entry's retry falls due RETRY_S after the fork, as it did after a rank's own measurement."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        entry = metrics.cpu_matmul_rates()
    finally:
        torch.set_num_threads(threads)
    if entry["provisional"]:
        entry["retry_at"] = time.monotonic() + metrics.RETRY_S


def _start(path, args, env, cwd, out_path, err_path, in_path=os.devnull):
    share_cpu_peak()
    process = multiprocessing.get_context("fork").Process(target=_run_forked_script,
                                                          args=(path, args, env, cwd, out_path, err_path, in_path))
    gc.freeze()  # the child's garbage collector then leaves this process's objects (and their pages) alone
    try:
        process.start()
    finally:
        gc.unfreeze()
    return process


class ForkedProcess:
    """Popen's handle (pid, poll, wait, send_signal, kill, returncode) for a process of start_forked."""

    def __init__(self, process):
        self.process, self.pid = process, process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.process), timeout)
        return self.process.exitcode

    def send_signal(self, sig):
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.process.kill()


def start_forked(script, args, log_path=os.devnull, env=None, cwd=ROOT):
    """Start `python script args` in a process forked from this one (see forked), stdout and stderr to log_path;
    return its Popen-like handle without waiting."""
    path = os.path.join(ROOT, script)
    _import_script_modules(path)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return ForkedProcess(_start(path, args, env, cwd, log_path, log_path))


def _import_script_modules(path):
    """Import the script's module, so that forked processes find its imports done; its `__main__` code does not
    run."""
    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    if module.startswith(("trainer.", "scripts.", "tests.")):
        importlib.import_module(module)


def forked(script, args, nproc=1, timeout=300, env=None, cwd=ROOT, torchrun_env=None, input=None):
    """`python script args` (nproc 1) or `torchrun --nproc_per_node nproc script args` (nproc > 1 or torchrun_env),
    in processes forked from this one (CPU only); return CompletedProcess with the ranks' output in rank order.
    `input`: text on every rank's stdin.

    The script runs as __main__ with the modules this process has imported already: a fresh interpreter spends
    ~8 s of CPU importing torch + transformers, which 8 torchrun workers pay 8 times on 2 cores. Use python() or
    torchrun() where the launcher itself (an elastic agent, signals to its process tree) is what a test checks."""
    path = os.path.join(ROOT, script)
    _import_script_modules(path)
    base = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    port, log_dir = free_port(), tempfile.mkdtemp()
    in_path = os.path.join(log_dir, "stdin")
    with open(in_path, "w") as f:
        f.write(input or "")
    processes = []
    for rank in range(nproc):
        for kind in ("out", "err"):
            open(os.path.join(log_dir, f"{rank}.{kind}"), "w").close()
        rank_env = base if not (nproc > 1 if torchrun_env is None else torchrun_env) else dict(
            base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
        log_base = os.path.join(log_dir, str(rank))
        processes.append(_start(path, args, rank_env, cwd, log_base + ".out", log_base + ".err", in_path))
    try:
        code = _wait_ranks(processes, timeout)
    finally:
        for p in processes:
            p.kill()
            p.join()
    outputs = {kind: "".join(open(os.path.join(log_dir, f"{rank}.{kind}"), errors="replace").read()
                             for rank in range(nproc)) for kind in ("out", "err")}
    shutil.rmtree(log_dir, ignore_errors=True)
    return subprocess.CompletedProcess([script, *map(str, args)], code, outputs["out"], outputs["err"])


def forked_nodes(script, args_by_node, timeout=300):
    """One rank per 'node', each with its own arguments (e.g. a --checkpoint_dir of its own: nodes that do not share
    a directory), forked as forked() does; returns (exit code, [stdout of each rank], [stderr of each rank])."""
    path = os.path.join(ROOT, script)
    _import_script_modules(path)
    port, log_dir, nodes = free_port(), tempfile.mkdtemp(), len(args_by_node)
    processes = []
    for rank, args in enumerate(args_by_node):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(nodes),
                   LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RESTART_COUNT="0")
        base = os.path.join(log_dir, str(rank))
        processes.append(_start(path, args, env, ROOT, base + ".out", base + ".err"))
    try:
        code = _wait_ranks(processes, timeout)
    finally:
        for p in processes:
            p.kill()
            p.join()
    outputs = [[open(os.path.join(log_dir, f"{rank}.{kind}"), errors="replace").read() for rank in range(nodes)]
               for kind in ("out", "err")]
    shutil.rmtree(log_dir, ignore_errors=True)
    return code, outputs[0], outputs[1]


def forked_argv(argv, log_path, timeout=300, env=None):
    """Run the argv of `python script ...` or `python -m torch.distributed.run [--nproc_per_node N] script ...` with
    forked() (`env` added to the environment), its output appended to log_path; the exit code. Tests put it in place
    of a script's trainer launcher."""
    script_at = next(i for i, arg in enumerate(argv) if arg.endswith(".py"))
    launcher, nproc = argv[1:script_at], 1
    for i, arg in enumerate(launcher):
        if arg.startswith("--nproc_per_node"):
            nproc = int(arg.split("=", 1)[1] if "=" in arg else launcher[i + 1])
    proc = forked(os.path.relpath(argv[script_at], ROOT), argv[script_at + 1:], nproc, timeout, env=env,
                  torchrun_env=launcher[:2] == ["-m", "torch.distributed.run"])
    with open(log_path, "a") as log:
        log.write(proc.stdout + proc.stderr)
    return proc.returncode


# the tests' tiny model: its MiniMindConfig fields, and the trainer flags that build it (fp32 throughout)
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_MODEL = [*(a for name, value in TINY_CONFIG.items() for a in (f"--{name}", str(value))),
              "--dtype", "float32", "--save_dtype", "float32"]


def read_metrics(path):
    """Per-step training records of a --metrics_file (validation records are skipped)."""
    with open(path) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def demo_slice(tmp_path, kind, n_lines, name=None):
    """The first n_lines of the embedded demo corpus, as a small data file for tests."""
    path = os.path.join(str(tmp_path), name or f"{kind}_{n_lines}.jsonl")
    with open(ensure_demo_data(kind)) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            if i >= n_lines:
                break
            dst.write(line)
    return path


def build_pipeline(model, pp_mesh, schedule_name, num_microbatches, loss_fn, device, micro_batch_shape):
    """Split `model` for this pp rank and build its schedule, unwrapped and fp32 (pipeline unit tests).

    Returns (schedule, stage_modules, has_first_stage, has_last_stage); the trainer goes through
    parallelize(), which wraps the stages (tp, dp) between the split and the schedule.
    """
    pp_group = pp_mesh.get_group()
    modules, stage_ids, num_stages = split_model(model, pp_group, schedule_name)
    schedule = make_schedule(modules, stage_ids, num_stages, schedule_name, num_microbatches, loss_fn, device,
                             pp_group, micro_batch_shape, model.config)
    return schedule, modules, modules[0].is_first, modules[-1].is_last

def preference_run_args(tmp_path, name, data, steps, dp=1, extra=()):
    """A preference stage's run (DPO, KTO, reward model) on TINY_MODEL from the seeded init (--from_weight none, also
    DPO's and KTO's reference): 4 rows per step in 2 micro-batches over `dp` ranks, every file under tmp_path/name."""
    out = os.path.join(str(tmp_path), name)
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "64", "--batch_size",
            str(2 // dp), "--accumulation_steps", "2", "--learning_rate", "1e-3", "--save_dir", out,
            "--checkpoint_dir", os.path.join(out, "ckpt"), "--cache_dir", os.path.join(out, "cache"),
            "--metrics_file", os.path.join(out, "metrics.jsonl"), "--log_interval", "1", "--max_steps", str(steps),
            *extra]


def preference_single_run(tmp_path, script, corpus, steps):
    """The single-process run a preference stage's other runs are compared with, on 40 rows of the demo `corpus`:
    (its argv, its records, the data file, its stdout)."""
    data = demo_slice(tmp_path, corpus, 40)
    argv = preference_run_args(tmp_path, "single", data, steps)
    proc = forked(script, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return argv, metrics_of(argv), data, proc.stdout


def metrics_of(argv):
    """The records of the run `argv` describes (its --metrics_file)."""
    return read_metrics(argv[argv.index("--metrics_file") + 1])


def write_rows(path, rows):
    """A JSONL file of `rows` (dicts, or lines already written as strings); returns its path as a string."""
    with open(path, "w") as f:
        f.writelines((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return str(path)


def kill_at_step(stage, run, step=3, timeout=300):
    """trainer/<stage>.py with `run`'s arguments through tests/helpers/fault_entry.py, SIGKILLed right after
    optimizer step
    `step` (what it saved by then stays on disk); asserts that it died there."""
    env = {"MINIMIND_TEST_STAGE": stage, "MINIMIND_TEST_KILL_AT_STEP": str(step)}
    killed = forked("tests/helpers/fault_entry.py", args=run, timeout=timeout, env=env)
    assert killed.returncode != 0 and f"SIGKILL rank 0 at step {step}" in killed.stdout + killed.stderr, \
        killed.stderr[-3000:]


def resume_run(script, run, step, timeout=300):
    """`script` with `run`'s arguments and --from_resume 1; asserts that it finished and says it resumed from `step`
    (a resume that trained nothing would not say so)."""
    resumed = forked(script, [*run, "--from_resume", "1"], timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from epoch 0, step {step}" in resumed.stdout, resumed.stdout[-3000:]
    return resumed


BAR = re.compile(r"tokenizing \S+: ")  # the token cache's tqdm bar (dataset/tokenizing/token_cache.py)


def stderr_lines(err):
    """stderr's lines less the token cache's progress bar: drawn once a build passes 1 s, which even a tiny file's does
    on a busy machine (a test that compares the error lines exactly failed on it under load)."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not BAR.match(line)]


def run_in_process(monkeypatch, capsys, script, argv):
    """(exit code, stderr lines less progress bars) of an entry script's main() under main_guard, in this process."""
    monkeypatch.setattr(sys, "argv", [f"{script.__name__.rsplit('.', 1)[-1]}.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        main_guard(script.main)
    return exit_info.value.code, stderr_lines(capsys.readouterr().err)
