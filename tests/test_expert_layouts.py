"""Expert parallelism in more layouts (trainer/parallel/expert.py through the real trainer): ep4 on 4 processes and
ep4 x dp2 on 8 equal the single process step by step; a checkpoint saved under one ep size resumes under another;
a SIGTERM under --ep 2 saves, and the resumed run equals the unkilled one to fp32 rounding (router bias included)."""
import os
import re
import shutil
import signal

import pytest
import torch

from tests.helpers.launch import demo_slice, forked, read_metrics
from tests.helpers.layouts import MODELS, SCRIPT, STEPS, assert_same_run, run_dir, run_layout
from tests.helpers.preempt_runs import finish, metrics_path, rank_pid, start, wait_for_step
from tests.helpers.preempt_runs import run_args as preempt_args

# name: (nproc, flags); ep is carved out of dp, so every process is a dp rank (tests/helpers/layouts.dp_size)
EP_LAYOUTS = {
    "dp2": (2, []),  # every rank all experts (DDP): a run that started without ep
    "ep2": (2, ["--ep", "2"]),
    "ep4": (4, ["--ep", "4"]),  # one expert per rank, top-2: every token visits two ranks
    "ep2_dp2": (4, ["--ep", "2"]),  # two replicas of each expert
}
# 8 dp ranks: one sample per rank and one micro-batch per step hold the reference's 8 samples of each step
EIGHT = (8, ["--ep", "4", "--zero_stage", "3", "--batch_size", "1", "--accumulation_steps", "1"])
EIGHT_TIMEOUT = 900  # 8 ranks on a few cores; the module's two references may run first (test_layouts' budget)
REFERENCE_TIMEOUT = 300


@pytest.fixture(scope="module")
def ep_runs(data, tmp_path_factory):  # noqa: F811
    """get(layout): that layout's 5-step MoE run, made once (its test checks it; resume tests reuse its step 4)."""
    runs = {}

    def get(layout):
        if layout not in runs:
            nproc, flags = EP_LAYOUTS[layout]
            workdir = tmp_path_factory.mktemp(layout)
            runs[layout] = run_layout(workdir, data, "moe", nproc, flags, ["--max_steps", str(STEPS)])
        return runs[layout]
    return get


def test_ep4_on_4_processes_equals_one_process(data, reference, ep_runs):  # noqa: F811
    """Every step's loss, aux loss and tokens equal the single process's, the gathered weights are the checkpoint's,
    and one process resumed from its step-4 checkpoint takes its last step (test_layouts.assert_same_run)."""
    assert_same_run(ep_runs("ep4"), data, "moe", reference["moe"])


@pytest.mark.timeout(EIGHT_TIMEOUT + 2 * REFERENCE_TIMEOUT + 60)
def test_ep4_dp2_zero3_on_8_processes_equals_one_process(data, reference, tmp_path):  # noqa: F811
    """`--ep 4 --zero_stage 3` on 8 processes: experts sharded over {0..3} and {4..7}, each expert's two replicas'
    gradients summed, the dense parts under FSDP2; the same checks against the single process."""
    nproc, flags = EIGHT
    workdir = run_layout(tmp_path, data, "moe", nproc, flags, ["--max_steps", str(STEPS)], timeout=EIGHT_TIMEOUT)
    assert_same_run(workdir, data, "moe", reference["moe"])


@pytest.mark.parametrize("save_layout,resume_layout", [("ep2", "ep4"), ("ep4", "ep2_dp2"), ("dp2", "ep4")])
def test_resume_under_another_ep_size(save_layout, resume_layout, data, reference, ep_runs, tmp_path):  # noqa: F811
    """A step-4 checkpoint written under one ep size (each rank its experts and their optimizer state, under global
    names) resumes under another (DCP reads each rank's experts by name; ep2_dp2 reads each expert twice), and a
    run without ep continues under ep4 (each rank reads its one expert of the replicated checkpoint): the
    resumed run's steps equal the single process's, and its last step is the single-process step."""
    saved, workdir, step_dir = ep_runs(save_layout), str(tmp_path), f"step_{STEPS - 1}"
    shutil.copytree(os.path.join(run_dir(saved, "moe"), step_dir), os.path.join(run_dir(workdir, "moe"), step_dir))
    shutil.copy(os.path.join(saved, "m.jsonl"), workdir)  # the resume cuts it back to the checkpoint's step
    nproc, flags = EP_LAYOUTS[resume_layout]
    run_layout(tmp_path, data, "moe", nproc, flags, ["--max_steps", str(STEPS), "--from_resume", "1"])
    assert_same_run(workdir, data, "moe", reference["moe"])


def killed_and_resumed(tmp_path, corpus, flags):
    """Run with `flags` on 2 processes, SIGTERM rank 1 past step 2, resume to 3 steps beyond the step reached;
    (records of that run, argv of an unkilled run to the same end, the step reached)."""
    def argv(name, steps):
        return [*preempt_args(tmp_path, name, corpus, steps), *flags]
    stopped = argv("split", 90)
    proc, log = start(stopped, 2)
    wait_for_step(proc, stopped, 2)
    os.kill(rank_pid(proc, 1), signal.SIGTERM)  # rank 0 learns it through the per-step agreement
    code, output = finish(proc, log)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", output)  # torchrun names each worker's exit code
    assert code != 0 and codes and set(codes) == {"143"}, output[-3000:]
    reached = read_metrics(metrics_path(stopped))[-1]["step"]
    assert f"preempted: stopped at step {reached} with its checkpoint" in output and "Done:" not in output
    end = reached + 3
    resumed = forked(SCRIPT, argv("split", end) + ["--from_resume", "1"], 2, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {reached}" in resumed.stdout.split("Resumed from", 1)[1].splitlines()[0]
    return read_metrics(metrics_path(stopped)), argv("full", end), reached


@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_kill_and_resume_under_ep_is_exact(balance, tmp_path):
    """`--ep 2` on 2 processes, MoE: the killed-and-resumed run's every loss, aux loss and token count and its final
    weights equal the unkilled run's bit for bit; under --router_balance bias the routers' bias state resumes too (the
    final expert_bias buffers equal the unkilled run's: a bias restarted at zero would lack the first steps' moves)."""
    corpus = demo_slice(tmp_path, "pretrain", 200)  # test_preempt's slice: 50 steps an epoch on 2 ranks
    flags = [*MODELS["moe"], "--ep", "2", "--router_balance", balance]
    split, full_argv, reached = killed_and_resumed(tmp_path, corpus, flags)
    ref = forked(SCRIPT, full_argv, 2, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    full = read_metrics(metrics_path(full_argv))
    assert [r["step"] for r in split] == [r["step"] for r in full] == list(range(1, reached + 4))
    for a, b in zip(full, split):  # same process count, same reduction order, same state: bit for bit
        assert a["loss"] == b["loss"] and a["aux_loss"] == b["aux_loss"] and a["tokens"] == b["tokens"], (a, b)
    weights = [torch.load(os.path.join(str(tmp_path), run, "pretrain_64_moe.pth")) for run in ("split", "full")]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[1]:  # every weight of the resumed run equals the unkilled run's, experts included
        assert torch.equal(weights[0][key], weights[1][key]), key
    biases = [key for key in weights[1] if key.endswith("expert_bias")]
    assert len(biases) == (2 if balance == "bias" else 0), sorted(weights[1])
    for key in biases:
        assert weights[1][key].abs().max() > 0 and torch.equal(weights[0][key], weights[1][key]), key
