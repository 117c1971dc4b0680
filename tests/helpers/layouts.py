"""Layout runs of the tiny model: the same run in every layout against the single-process reference (the data and
reference fixtures are in conftest.py)."""
import math
import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.launch import TINY_MODEL, forked, read_metrics
from tests.helpers.numerics import FP32_EPS, GRAD_ULPS, grad_norm_bound

SCRIPT = "trainer/train_pretrain.py"


STEPS = 5


GLOBAL_BATCH = 4  # samples per micro-batch over all dp ranks; 2 micro-batches per step


REFERENCE_TIMEOUT = 300  # one single-process reference run


MODELS = {"dense": [], "moe": ["--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2"]}


def dp_size(nproc, flags):
    model_parallel = 1
    for name in ("--tp", "--pp", "--cp"):
        if name in flags:
            model_parallel *= int(flags[flags.index(name) + 1])
    return nproc // model_parallel


def run_args(workdir, data, model, dp, extra=()):
    return [*TINY_MODEL, *MODELS[model], "--data_path", data, "--max_seq_len", "32",
            "--batch_size", str(GLOBAL_BATCH // dp), "--accumulation_steps", "2", "--learning_rate", "1e-3",
            "--log_interval", "1", "--save_dir", os.path.join(workdir, "out"),
            "--checkpoint_dir", os.path.join(workdir, "ckpt"), "--metrics_file", os.path.join(workdir, "m.jsonl"),
            "--save_interval", str(STEPS - 1), *extra]  # checkpoints at STEPS-1 and at the end: assert_same_run


def weight_stem(model):
    return "pretrain_64_moe" if model == "moe" else "pretrain_64"


def final_weights(workdir, model):
    """The weights the run gathered at its end (fp32: TINY_MODEL saves float32)."""
    return torch.load(os.path.join(workdir, "out", f"{weight_stem(model)}.pth"))


def read_step(step_dir, tmp):
    """A DCP step directory as full tensors: (model by FQN, optimizer state by FQN, param groups by FQN)."""
    path = os.path.join(tmp, "full.pt")
    dcp_to_torch_save(step_dir, path)
    full = torch.load(path, weights_only=False)
    os.remove(path)
    state, groups = {}, {}
    for key, value in full["optim"].items():
        section, rest = key.split(".", 1)
        fqn, name = rest.rsplit(".", 1)
        (state if section == "state" else groups).setdefault(fqn, {})[name] = value
    return full["model"], state, groups


def run_dir(workdir, model):
    return os.path.join(workdir, "ckpt", weight_stem(model))


def assert_same_records(records, ref_records, num_params):
    """Every step's loss, aux loss and token count equal the single process's; step 1's gradient norm (same weights,
    same batch, another reduction order and norm code: DTensor shards, pipeline stages) within
    tests/helpers/numerics.py's grad_norm_bound (later steps start from weights that differ by AdamW's rounding)."""
    assert [r["step"] for r in records] == [r["step"] for r in ref_records] == list(range(1, STEPS + 1))
    for got, want in zip(records, ref_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got["step"], got["loss"], want["loss"])
        assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-5, abs=1e-7)
        assert got["tokens"] == want["tokens"]
    got, want = records[0]["grad_norm"], ref_records[0]["grad_norm"]
    assert abs(got - want) <= grad_norm_bound(want, num_params), (got, want, grad_norm_bound(want, num_params))


def assert_same_run(workdir, data, model, ref_records, single=None):
    """The layout's run is the single-process run, compared where that is well-conditioned.

    Two AdamW trajectories are not (a near-zero gradient's last-bit rounding flips lr * g / (|g| + eps),
    differently on AVX2 and AVX-512; tests/helpers/numerics.py), so final weights are not compared with the reference's.
    Instead: (1) every step's loss, aux loss and token count equal the single process's; (2) the exported .pth is
    the run's own final checkpoint, gathered another way; (3) the last step is the single-process step: a single
    process resumed from the layout's step STEPS-1 checkpoint takes the same step (its exp_avg, linear in the
    gradient, equals the layout's within gradient rounding), and the layout's final weights are float64 AdamW of
    its own step STEPS-1 weights and step STEPS moments, within fp32 rounding. `single`: a folder where that single
    process step was taken already."""
    records, weights = read_metrics(os.path.join(workdir, "m.jsonl")), final_weights(workdir, model)
    assert_same_records(records, ref_records, sum(w.numel() for w in weights.values()))
    last, before = (os.path.join(run_dir(workdir, model), f"step_{n}") for n in (STEPS, STEPS - 1))
    final, state, groups = read_step(last, workdir)
    assert weights.keys() <= final.keys() and all(weights[k].equal(final[k]) for k in weights)
    prior, prior_state, _ = read_step(before, workdir)

    if single is None:  # one single-process step from the layout's step STEPS-1
        single = os.path.join(workdir, "single")
        shutil.copytree(before, os.path.join(run_dir(single, model), f"step_{STEPS - 1}"))
        proc = forked(SCRIPT, run_args(single, data, model, 1, ["--max_steps", str(STEPS), "--from_resume", "1"]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    _, single_state, _ = read_step(os.path.join(run_dir(single, model), f"step_{STEPS}"), workdir)

    assert state.keys() == single_state.keys() and records[-1]["lr"] > 0
    for fqn, moments in state.items():
        group, m_before = groups[fqn], prior_state[fqn]["exp_avg"].double()
        (beta1, beta2), lr, step = group["betas"], group["lr"], int(moments["step"])
        assert step == STEPS and lr == pytest.approx(records[-1]["lr"], rel=1e-6)
        grad = (single_state[fqn]["exp_avg"].double() - beta1 * m_before) / (1 - beta1)  # the single process's
        tol = (1 - beta1) * GRAD_ULPS * FP32_EPS * grad.abs().max() + 4 * FP32_EPS * (beta1 * m_before.abs()
                                                                                       + (1 - beta1) * grad.abs())
        diff = (moments["exp_avg"].double() - single_state[fqn]["exp_avg"].double()).abs()
        assert (diff <= tol).all(), (fqn, float((diff - tol).max()), float(tol.max()))
        denom = moments["exp_avg_sq"].double().sqrt() / math.sqrt(1 - beta2 ** step) + group["eps"]
        update = lr / (1 - beta1 ** step) * moments["exp_avg"].double() / denom
        w = prior[fqn].double()
        expected = w * (1 - lr * group["weight_decay"]) - update
        bound = FP32_EPS * (6 * update.abs() + 3 * w.abs())  # sqrt, division, addcdiv; decay multiply and add
        excess = (final[fqn].double() - expected).abs() - bound
        assert (excess <= 0).all(), (fqn, float(excess.max()), float(bound.max()))


def run_layout(tmp_path, data, model, nproc, flags, extra=(), timeout=420):
    workdir = str(tmp_path)
    args = run_args(workdir, data, model, dp_size(nproc, flags), [*flags, *extra])
    proc = forked(SCRIPT, args, nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return workdir
