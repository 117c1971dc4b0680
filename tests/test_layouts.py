"""The proof of 4D parallelism: every layout computes what the single-process run computes.

Each layout runs the real trainer/train_pretrain.py with torchrun's environment (gloo, CPU; the ranks are forked
from the test: tests/helpers/launch.py forked) for 5 steps on the same global batches as a single-process run: the
per-step losses are compared with it, the exported weights with the run's own checkpoint, and the last step with a
single process stepping from the layout's own state (assert_same_run says why not final weights against final
weights). Rows are packed with the default --doc_mask 1 (attention within documents, in every layout: SDPA's mask,
each pipeline stage's, the ring's per-block mask).
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT, TINY_MODEL, forked, free_port, read_metrics
from tests.helpers.layouts import (
    MODELS,
    REFERENCE_TIMEOUT,
    SCRIPT,
    STEPS,
    assert_same_records,
    assert_same_run,
    final_weights,
    run_args,
    run_dir,
    run_layout,
)

# name: (nproc, flags)
LAYOUTS = {
    "dp2": (2, []),
    "tp2": (2, ["--tp", "2"]),
    "tp2_sequence_parallel": (2, ["--tp", "2", "--sequence_parallel", "1"]),
    "pp2": (2, ["--pp", "2"]),
    "cp2": (2, ["--cp", "2"]),
    "dp2xtp2": (4, ["--tp", "2"]),
    "dp2xpp2": (4, ["--pp", "2"]),
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2"]),
    "tp2xcp2": (4, ["--tp", "2", "--cp", "2"]),
    "pp2xcp2": (4, ["--pp", "2", "--cp", "2"]),
    "dp2xcp2": (4, ["--cp", "2"]),
    "zero3_dp2": (2, ["--zero_stage", "3"]),
    "dp2xtp2xpp2": (8, ["--tp", "2", "--pp", "2"]),
    "tp2xpp2xcp2": (8, ["--tp", "2", "--pp", "2", "--cp", "2"]),
}
SLOW_LAYOUTS = {"dp2xtp2xpp2xcp2": (16, ["--tp", "2", "--pp", "2", "--cp", "2"])}
RESUME_LAYOUTS = dict(LAYOUTS, zero1_dp2=(2, ["--zero_stage", "1"]))


@pytest.fixture(scope="module")
def layout_runs(data, tmp_path_factory):
    """get(layout, model): that layout's 5-step run, made once; the layout test checks it, the resume tests resume
    its step STEPS-1 checkpoint in another layout."""
    runs = {}

    def get(layout, model, extra=()):
        if (layout, model) not in runs:
            nproc, flags = RESUME_LAYOUTS[layout]
            workdir = tmp_path_factory.mktemp(f"{layout}_{model}")
            runs[layout, model] = run_layout(workdir, data, model, nproc, flags, ["--max_steps", str(STEPS), *extra])
        return runs[layout, model]
    return get


def test_doc_mask_changes_the_run(data, reference, tmp_path):
    """The packed rows hold several documents, so the mask matters: the layouts below test something."""
    proc = forked(SCRIPT, run_args(str(tmp_path), data, "dense", 1, ["--max_steps", "3", "--doc_mask", "0"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    unmasked, masked = read_metrics(os.path.join(str(tmp_path), "m.jsonl")), reference["dense"][:3]
    assert [r["tokens"] for r in unmasked] == [r["tokens"] for r in masked]
    assert masked[0]["loss"] != unmasked[0]["loss"]  # step 1: same weights, other attention
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(masked[1:], unmasked[1:]))


# MoE runs on every layout of one dimension (each has MoE code of its own: DDP's unused experts, expert sharding
# under tp and sequence parallel, aux loss across pp stages, router stats over cp, FSDP2 experts); the composites
# combine those same paths and run dense, and the MoE model composes all five in test_16_process_layout
MOE_LAYOUTS = ("dp2", "tp2", "tp2_sequence_parallel", "pp2", "cp2", "zero3_dp2")
# dp2 dense: test_ranks_build_one_token_cache_together
CASES = [(layout, "dense") for layout in LAYOUTS if layout != "dp2"] + [(layout, "moe") for layout in MOE_LAYOUTS]


@pytest.mark.parametrize("layout,model", CASES, ids=[f"{layout}-{model}" for layout, model in CASES])
def test_layout_matches_single_process(layout, model, data, reference, layout_runs):
    assert_same_run(layout_runs(layout, model), data, model, reference[model])


def test_ranks_build_one_token_cache_together(data, reference, layout_runs, tmp_path_factory):
    """The dp2 dense case, on an empty --cache_dir: the two ranks tokenize half the file each into one cache (no
    leftovers), and the run still equals the single process (whose cache was built by one process)."""
    cache = tmp_path_factory.mktemp("cache")
    workdir = layout_runs("dp2", "dense", ["--cache_dir", str(cache), "--num_proc", "1"])
    assert len(os.listdir(cache)) == 1 and os.path.isfile(cache / os.listdir(cache)[0] / "meta.json")
    assert_same_run(workdir, data, "dense", reference["dense"])


SIXTEEN_TIMEOUT = 900  # its 16 ranks on a few cores; pytest.ini's 600 s is raised for it, references included


@pytest.mark.timeout(SIXTEEN_TIMEOUT + len(MODELS) * REFERENCE_TIMEOUT + 60)
def test_16_process_layout(data, reference, tmp_path):
    """dp2 x tp2 x pp2 x cp2 with the MoE model's expert parallel (--ep 2 within dp): all five dimensions at once.
    One model: the MoE model's attention, norms and embeddings are the dense model's code, and its dense MLP
    composites run in the dense cases above (dp2xtp2xpp2, tp2xpp2xcp2); only the MoE model adds the fifth
    dimension."""
    nproc, flags = SLOW_LAYOUTS["dp2xtp2xpp2xcp2"]
    workdir = run_layout(tmp_path, data, "moe", nproc, [*flags, "--ep", "2"], ["--max_steps", str(STEPS)],
                         timeout=SIXTEEN_TIMEOUT)
    assert_same_run(workdir, data, "moe", reference["moe"])


@pytest.mark.parametrize("save_layout,resume_layout", [("dp2xtp2", "pp2"), ("dp2xtp2", "single"),
                                                       ("zero3_dp2", "single"), ("cp2", "single"), ("dp2xpp2", "dp2"),
                                                       ("zero1_dp2", "zero3_dp2")])
def test_resume_under_a_different_layout(save_layout, resume_layout, data, reference, layout_runs, tmp_path):
    """Resume one layout's step STEPS-1 DCP checkpoint in another layout (DCP reshards): the curve and the final
    weights continue as if uninterrupted (the last step is checked to gradient rounding: assert_same_run)."""
    saved, workdir = layout_runs(save_layout, "dense"), str(tmp_path)
    step_dir = f"step_{STEPS - 1}"
    shutil.copytree(os.path.join(run_dir(saved, "dense"), step_dir), os.path.join(run_dir(workdir, "dense"), step_dir))
    shutil.copy(os.path.join(saved, "m.jsonl"), workdir)  # the resume cuts it back to the checkpoint's step
    resume = ["--max_steps", str(STEPS), "--from_resume", "1"]
    if resume_layout == "single":
        proc = forked(SCRIPT, run_args(workdir, data, "dense", 1, resume))
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_metrics(os.path.join(workdir, "m.jsonl"))
        num_params = sum(w.numel() for w in final_weights(workdir, "dense").values())
        assert_same_records(records, reference["dense"], num_params)
        # this run's last step is a single-process step from the saved layout's step STEPS-1: the saved layout took
        # that step itself, independently, in its own layout; the two agree (the layout's run against this step)
        assert_same_run(saved, data, "dense", reference["dense"], single=workdir)
    else:
        run_layout(tmp_path, data, "dense", *RESUME_LAYOUTS[resume_layout], resume)
        assert_same_run(workdir, data, "dense", reference["dense"])


@pytest.mark.parametrize("nproc,flags,needle", [
    (2, ["--tp", "3"], "not divisible by pp*cp*tp"),
    (2, ["--tp", "2", "--num_key_value_heads", "1"], "must divide num_key_value_heads"),
    (2, ["--cp", "2", "--max_seq_len", "34"], "divisible by 2*cp"),
    (2, ["--pp", "2", "--num_hidden_layers", "1"], "layers"),
    (2, ["--pp", "2", "--accumulation_steps", "1"], "micro"),
    (2, ["--zero_stage", "5"], "--zero_stage"),
])
def test_bad_layout_rejected_on_every_rank(nproc, flags, needle, data, tmp_path):
    args = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
            "--save_dir", str(tmp_path), "--checkpoint_dir", str(tmp_path)]
    args = args + flags  # later flags win
    start = time.time()
    proc = forked(SCRIPT, args, nproc, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and time.time() - start < 60
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]  # one line, from rank 0 only
    assert "| loss " not in proc.stdout  # no step was logged


def test_a_dying_rank_stops_the_others(data, tmp_path):
    """Kill one worker mid-training: the launcher and the surviving rank exit within 60 s, no hang."""
    args = run_args(str(tmp_path), data, "dense", 2, ["--max_steps", "100000", "--epochs", "1000"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, SCRIPT), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = os.path.join(str(tmp_path), "m.jsonl")
        deadline = time.time() + 180
        while not (os.path.exists(metrics) and len(read_metrics(metrics)) >= 2):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.5)
        workers = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train_pretrain.py"], capture_output=True,
                                 text=True)
        pids = [int(p) for p in workers.stdout.split()]
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        proc.wait(timeout=90)
        assert time.time() - killed_at < 60 and proc.returncode != 0
        assert all(subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode != 0 for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
