"""trainer/runtime/optimizer_choice.py and optimizers.py: LAMB and LARS against the papers' updates worked out by hand
here in float64, Muon + AdamW against torch's two optimizers run side by side, and every optimizer in a sharded layout
of the real trainer against the single process, resumed from a checkpoint (of another layout for LAMB)."""
import argparse
import math
import os

import pytest
import torch

from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics, run_in_process
from tests.helpers.layouts import read_step
from trainer import train_pretrain
from trainer.parallel.mesh import ParallelDims
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.runtime.optimizer_choice import build_optimizer
from trainer.runtime.optimizers import Lamb, Lars, MuonWithAdamW

W0 = [[0.5, -1.0, 2.0], [0.0, 0.25, -0.75]]  # one weight matrix
B0 = [0.0, 0.0, 0.0]  # a zero-initialised vector: its trust ratio is 1
GRADS = [([[0.1, -0.2, 0.3], [0.05, 0.0, -0.4]], [0.2, -0.1, 0.05]),
         ([[-0.3, 0.1, 0.2], [0.15, -0.25, 0.1]], [0.0, 0.0, 0.0])]  # a zero gradient: LARS's ratio is 1


def norm(x):
    return math.sqrt(sum(v * v for row in x for v in (row if isinstance(row, list) else [row])))


def elementwise(f, *xs):
    """f applied element by element over equally shaped nested lists."""
    if isinstance(xs[0], list):
        return [elementwise(f, *parts) for parts in zip(*xs)]
    return f(*xs)


def lamb_by_hand(lr, b1, b2, eps, wd):
    """You et al. 2019, Algorithm 2, per tensor, in Python floats: m, v, bias correction, r + wd w, ||w|| / ||u||."""
    weights, moments = [W0, B0], [None, None]
    for step, grads in enumerate(GRADS, 1):
        for i, (w, g) in enumerate(zip(weights, grads)):
            m, v = moments[i] or (elementwise(lambda _: 0.0, w), elementwise(lambda _: 0.0, w))
            m = elementwise(lambda m, g: b1 * m + (1 - b1) * g, m, g)
            v = elementwise(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
            u = elementwise(lambda m, v, w: (m / (1 - b1 ** step)) / (math.sqrt(v / (1 - b2 ** step)) + eps) + wd * w,
                            m, v, w)
            ratio = norm(w) / norm(u) if norm(w) > 0 and norm(u) > 0 else 1.0
            weights[i] = elementwise(lambda w, u: w - lr * ratio * u, w, u)
            moments[i] = (m, v)
    return weights


def lars_by_hand(lr, momentum, wd, eta):
    """You, Gitman, Ginsburg 2017, Algorithm 1, per tensor: local lr eta ||w|| / (||g|| + wd ||w||), momentum."""
    weights, buffers = [W0, B0], [None, None]
    for grads in GRADS:
        for i, (w, g) in enumerate(zip(weights, grads)):
            local = eta * norm(w) / (norm(g) + wd * norm(w)) if norm(w) > 0 and norm(g) > 0 else 1.0
            v = buffers[i] or elementwise(lambda _: 0.0, w)
            v = elementwise(lambda v, g, w: momentum * v + lr * local * (g + wd * w), v, g, w)
            weights[i] = elementwise(lambda w, v: w - v, w, v)
            buffers[i] = v
    return weights


def run_optimizer(make):
    params = [torch.nn.Parameter(torch.tensor(W0)), torch.nn.Parameter(torch.tensor(B0))]
    optimizer = make(params)
    for grads in GRADS:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        optimizer.step()
    return [p.detach().double() for p in params]


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_trust_ratio_optimizers_take_the_papers_update(name):
    if name == "lamb":
        got = run_optimizer(lambda p: Lamb(p, lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01))
        want = lamb_by_hand(0.1, 0.9, 0.99, 1e-6, 0.01)
    else:
        got = run_optimizer(lambda p: Lars(p, lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02))
        want = lars_by_hand(0.5, 0.9, 0.01, 0.02)
    for g, w in zip(got, want):
        w = torch.tensor(w, dtype=torch.float64)
        # fp32 against float64: a few roundings of values of the weights' size (at most 3) per step
        assert torch.allclose(g, w, rtol=0, atol=16 * 2 ** -24 * 3), (name, g, w)
    assert not torch.equal(got[1], torch.zeros(3, dtype=torch.float64))  # the zero vector moved (ratio 1)


def tiny_model():
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=64, vocab_size=64))


def plan_for(*argv, world_size=1):
    args = add_train_args(argparse.ArgumentParser()).parse_args([*TINY_MODEL, "--device", "cpu", *argv])
    return resolve(args, world_size)


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest_as_torch_does():
    """--optimizer muon = torch.optim.Muon on model.layers.* matrices + torch.optim.AdamW on the rest, stepped apart
    (torch's documented use); after a state_dict round trip the wrapper still steps as they do."""
    model, reference = tiny_model(), tiny_model()
    plan = plan_for("--optimizer", "muon", "--learning_rate", "0.01", "--weight_decay", "0.05")
    dims = ParallelDims.build(1)
    optimizer = build_optimizer([model], plan, dims)
    assert isinstance(optimizer, MuonWithAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if n.startswith("model.layers.") and p.ndim == 2}
    hidden = [p for n, p in reference.named_parameters() if n in muon]
    rest = [p for n, p in reference.named_parameters() if n not in muon]
    torch_optimizers = [torch.optim.Muon(hidden, lr=0.01, momentum=0.95, weight_decay=0.05,
                                         adjust_lr_fn="match_rms_adamw"),
                        torch.optim.AdamW(rest, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for m in (model, reference):
            m(ids, labels=ids).loss.backward()
        optimizer.step()
        for o in torch_optimizers:
            o.step()
        optimizer.zero_grad()
        reference.zero_grad()
        if step == 0:  # a resume: a new wrapper loads the state
            state = optimizer.state_dict()
            optimizer = build_optimizer([model], plan, dims)
            optimizer.load_state_dict(state)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def adamw_by_hand(lr, b1, b2, eps, wd):
    """Loshchilov & Hutter 2019 (torch's AdamW) in Python floats: w decays by lr wd, then the bias-corrected step."""
    weights, moments = [W0, B0], [None, None]
    for step, grads in enumerate(GRADS, 1):
        for i, (w, g) in enumerate(zip(weights, grads)):
            m, v = moments[i] or (elementwise(lambda _: 0.0, w), elementwise(lambda _: 0.0, w))
            m = elementwise(lambda m, g: b1 * m + (1 - b1) * g, m, g)
            v = elementwise(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
            weights[i] = elementwise(lambda w, m, v: w * (1 - lr * wd) - lr * (m / (1 - b1 ** step)) / (
                math.sqrt(v / (1 - b2 ** step)) + eps), w, m, v)
            moments[i] = (m, v)
    return weights


def test_cpu_adamw_is_torchs_fused_kernel_and_takes_the_papers_update():
    """On CPU the trainer's AdamW is torch's fused kernel (faster than the per-tensor loop), and its two steps are
    AdamW's by hand within float32 rounding (weights of order 1: 1e-6)."""
    plan = plan_for("--learning_rate", "0.01", "--weight_decay", "0.1")
    optimizer = build_optimizer([tiny_model()], plan, ParallelDims.build(1))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["fused"] is True
    got = run_optimizer(lambda params: build_optimizer([torch.nn.ParameterList(params)], plan, ParallelDims.build(1)))
    for g, w in zip(got, adamw_by_hand(0.01, 0.9, 0.999, 1e-8, 0.1)):
        torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float64), rtol=0, atol=1e-6)


def test_bad_optimizer_values_are_one_line():
    for argv, needle in ((["--beta2", "1.0"], "--beta2 must be in [0, 1)"), (["--eps", "0"], "--eps must be positive"),
                         (["--optimizer", "sgd", "--momentum", "1.5"], "--momentum must be in [0, 1)")):
        with pytest.raises(ConfigError, match=needle.replace("[", "\\[").replace(")", "\\)")):
            plan_for(*argv)
    with pytest.raises(ConfigError, match="--optimizer muon orthogonalises each whole matrix"):
        plan_for("--optimizer", "muon", "--zero_stage", "3", world_size=2)


# ----------------------------------------------------------------------------------------------- real runs
STEPS = 4
# optimizer: (flags, processes and layout of the first half, of the resumed second half); LAMB goes from FSDP2
# shards to pipeline stages
RUNS = {
    "lamb": (["--optimizer", "lamb", "--learning_rate", "1e-2"], (2, ["--zero_stage", "3"]), (2, ["--pp", "2"])),
    "lars": (["--optimizer", "lars", "--learning_rate", "2.0"], (2, ["--zero_stage", "1"]), (2, ["--zero_stage", "1"])),
    "sgd": (["--optimizer", "sgd", "--learning_rate", "0.05"], (2, ["--tp", "2"]), (2, ["--tp", "2"])),
    "muon": (["--optimizer", "muon"], (2, ["--zero_stage", "1"]), (2, ["--zero_stage", "1"])),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_slice(tmp_path_factory.mktemp("data"), "pretrain", 96)


def run_args(workdir, data, dp, extra):
    return [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", str(4 // dp),
            "--accumulation_steps", "2", "--learning_rate", "1e-3", "--log_interval", "1", "--save_interval", "1",
            "--max_steps", str(STEPS), "--save_dir", os.path.join(workdir, "out"),
            "--checkpoint_dir", os.path.join(workdir, "ckpt"), "--metrics_file", os.path.join(workdir, "m.jsonl"),
            *extra]


@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_layout_resumes_to_the_single_process_losses(name, data, tmp_path):
    """The single process runs STEPS steps; the layout runs the first half, stops (--max_tokens, so the lr schedule
    keeps its length), and resumes from its checkpoint (LAMB: in another layout, DCP resharding its moments): every
    step's loss equals the single process's within the layouts' reduction-order rounding."""
    flags, (n1, first), (n2, second) = RUNS[name]
    ref = forked("trainer/train_pretrain.py", run_args(str(tmp_path / "ref"), data, 1, flags))
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = read_metrics(str(tmp_path / "ref" / "m.jsonl"))
    half = reference[STEPS // 2 - 1]["tokens"]
    run = str(tmp_path / "run")
    for nproc, layout, extra in ((n1, first, ["--max_tokens", str(half)]), (n2, second, ["--from_resume", "1"])):
        dp = nproc // (2 if {"--tp", "--pp"} & set(layout) else 1)
        proc = forked("trainer/train_pretrain.py", run_args(run, data, dp, [*flags, *layout, *extra]), nproc,
                      timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"stopped: --max_tokens {half}" in open(os.path.join(run, "out", "logs", "pretrain_64_rank_0.log")).read()
    records = read_metrics(os.path.join(run, "m.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference):
        assert got["tokens"] == want["tokens"] and got["lr"] == want["lr"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got["step"], got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (got["step"], got["grad_norm"])
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.01  # the optimizer moved the weights
    # the state the resumed half built on is the single process's: a lost state (fresh moments after the resume)
    # differs by its own size, the layouts' gradient rounding by ~1e-5 of it (GRAD_ULPS ulp, grown over 4 steps);
    # Muon orthogonalises in bfloat16 (torch's), where inputs a few fp32 ulp apart round 2^-8 apart
    tolerance = 2 ** -8 if name == "muon" else 1e-4
    _, state, _ = read_step(os.path.join(run, "ckpt", "pretrain_64", f"step_{STEPS}"), str(tmp_path))
    _, ref_state, _ = read_step(str(tmp_path / "ref" / "ckpt" / "pretrain_64" / f"step_{STEPS}"), str(tmp_path))
    assert state.keys() == ref_state.keys() and state
    for fqn, values in ref_state.items():
        assert values.keys() == state[fqn].keys() and values, fqn
        for key, want in values.items():
            got, scale = state[fqn][key].double(), want.double().abs().max()
            assert (got - want.double()).abs().max() <= tolerance * scale, (fqn, key)


def test_a_resume_with_another_optimizer_is_one_line(tmp_path, monkeypatch, capsys):
    """An optimizer's state has its own entries (SGD's momentum buffer, AdamW's two moments): a resume with another
    --optimizer names both in one line, exit 2, before any step (it was a DCP traceback, 'Missing key in checkpoint
    state_dict: optim.state...exp_avg', after the model was built)."""
    data = demo_slice(tmp_path, "pretrain", 40)
    run = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "64", "--batch_size", "2", "--accumulation_steps", "1",
           "--max_steps", "2", "--save_dir", tmp_path / "out", "--checkpoint_dir", tmp_path / "ckpt"]
    assert run_in_process(monkeypatch, capsys, train_pretrain, [*run, "--optimizer", "sgd"])[0] == 0
    code, err = run_in_process(monkeypatch, capsys, train_pretrain,
                               [*run, "--optimizer", "adamw", "--from_resume", "1", "--max_steps", "3"])
    step = tmp_path / "ckpt" / "pretrain_64" / "step_2"
    assert (code, err[-1:]) == (2, [f"error: {step} was saved with --optimizer sgd, this run has --optimizer adamw; "
                                    "pass --optimizer sgd to continue it, or --from_resume 0 to start over"]), err
