"""Launch real multi-process (gloo, CPU) jobs from tests, always with a timeout."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataset.demo_data import ensure_demo_data
from trainer.parallel.pipeline import make_schedule, split_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def spawn(fn, world_size, *args, timeout=120):
    """Run fn(rank, world_size, *args) in world_size processes with a gloo group; raise on any failure.

    fn must be a module-level function. Ranks that fail write their traceback, which is re-raised here.
    """
    error_dir = tempfile.mkdtemp()
    ctx = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, error_dir),
                             nprocs=world_size, join=False, start_method="spawn")
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


def torchrun(script, nproc, args, timeout=300, env=None):
    """Run `torchrun --nproc_per_node nproc script args` on CPU; return CompletedProcess (never hangs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.path.join(ROOT, script), *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def python(script, args, timeout=300, env=None, cwd=ROOT):
    """Run `python script args` in one process (in `cwd`, default the repo root); return CompletedProcess."""
    cmd = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


TINY_MODEL = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
              "--num_key_value_heads", "2", "--dtype", "float32", "--save_dtype", "float32"]


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
