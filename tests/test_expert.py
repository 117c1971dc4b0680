"""trainer/parallel/expert.py on 2 real gloo processes: expert-parallel forward and backward equal one process on the
whole batch (loss, aux loss, every gradient), top-1 and top-2, with and without shared experts; a DCP checkpoint
written under ep2 loads into the plain model; ep_validate's lines."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import forked, read_metrics, spawn
from tests.helpers.layouts import SCRIPT, STEPS, assert_same_run, run_args, run_layout
from tests.helpers.numerics import FP32_EPS, GRAD_ULPS
from trainer.parallel.expert import apply_expert_parallel, ep_validate

BATCH, SEQ, VOCAB = 4, 12, 96


def tiny_moe(top_k, shared):
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        use_moe=True, num_experts=4, num_experts_per_tok=top_k, moe_intermediate_size=48, n_shared_experts=shared))


def batch():
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1))


def step_loss(model, rows, total_tokens, total_rows):
    """This part's share of the step loss: CE summed over its tokens / all tokens + aux * its rows / all rows."""
    out = model(rows[:, :-1])
    ce = F.cross_entropy(out.logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1), reduction="sum") / total_tokens
    return ce, out.aux_loss * rows.shape[0] / total_rows


def _ep_worker(rank, world_size, top_k, shared, out_dir):
    model = apply_expert_parallel(tiny_moe(top_k, shared), dist.group.WORLD)
    model.train()
    rows = batch()[rank * 2:(rank + 1) * 2]  # each rank its half of the batch
    ce, aux = step_loss(model, rows, BATCH * SEQ, BATCH)
    (ce + aux).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if ".experts." not in name:  # replicated: the ranks' parts sum, as data parallel reduces them
            dist.all_reduce(grad)
        grads[name] = grad
    losses = torch.stack([ce.detach(), aux.detach()])
    dist.all_reduce(losses)
    torch.save(dict(grads=grads, losses=losses), os.path.join(out_dir, f"rank{rank}.pt"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(out_dir, "dcp"))


def assert_grad_close(grad, ref, name):
    """Within GRAD_ULPS of the reference's largest element (another summation order: tests/helpers/numerics.py)."""
    bound = GRAD_ULPS * FP32_EPS * ref.abs().max()
    assert (grad - ref).abs().max() <= bound, (name, float((grad - ref).abs().max()), float(bound))


@pytest.mark.parametrize("top_k,shared", [(1, 0), (2, 0), (1, 1), (2, 1)])
def test_ep2_equals_one_process(top_k, shared, tmp_path):
    spawn(_ep_worker, 2, top_k, shared, str(tmp_path), start_method="fork")
    single = tiny_moe(top_k, shared)
    ce, aux = step_loss(single, batch(), BATCH * SEQ, BATCH)
    (ce + aux).backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for part in ranks:
        for what, value, ref in zip(("ce", "aux"), part["losses"], (ce, aux)):
            assert abs(float(value - ref.detach())) <= GRAD_ULPS * FP32_EPS * abs(float(ref.detach())), what
    held = {}
    for rank, part in enumerate(ranks):
        experts = {name for name in part["grads"] if ".experts." in name}
        assert all(int(name.split(".experts.")[1].split(".")[0]) // 2 == rank for name in experts)  # its own share
        held.update(part["grads"])
    reference_grads = dict(single.named_parameters())
    assert sorted(held) == sorted(reference_grads)  # every parameter on some rank
    for name, param in reference_grads.items():
        assert_grad_close(held[name], param.grad, name)
    plain = tiny_moe(top_k, shared)
    with torch.no_grad():
        for param in plain.parameters():
            param.zero_()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))  # written by 2 ranks, each with its experts
    for name, value in tiny_moe(top_k, shared).state_dict().items():
        assert torch.equal(state[name], value), name


def test_ep_validate_lines():
    moe = MiniMindConfig(use_moe=True, num_experts=4)
    assert ep_validate(moe, 1) is None and ep_validate(moe, 4) is None
    assert "num_experts=4" in ep_validate(moe, 3)
    assert "--use_moe 1" in ep_validate(MiniMindConfig(), 2)


def test_ep2_training_run_equals_one_process(data, reference, tmp_path):  # noqa: F811 (test_layouts' fixtures)
    """`--ep 2` on 2 processes (DDP for the rest): every step's loss, aux loss and tokens equal the single process's,
    its gathered weights are its checkpoint's, and one process resumed from its step-4 checkpoint (written by the
    two ranks, each with its experts) takes the layout's last step (tests/test_layouts.assert_same_run)."""
    workdir = run_layout(tmp_path, data, "moe", 2, ["--ep", "2"], ["--max_steps", str(STEPS)])
    assert_same_run(workdir, data, "moe", reference["moe"])


@pytest.mark.parametrize("zero", ["0", "2", "3"])  # DDP, FSDP2 (ZeRO-2/3) on the dense parts
def test_ep2_dp2_training_run_equals_one_process(zero, data, reference, tmp_path):  # noqa: F811
    """`--ep 2` on 4 processes (ep carved out of dp 4: experts sharded over ranks {0,1} and {2,3}, each expert's two
    replicas' gradients summed over {0,2} / {1,3}; the dense parts under DDP or FSDP2): every step's loss, aux loss,
    tokens and gradient norm equal the single process's (the norm within the harness's loss bound: the same
    trajectory), and the checkpoint/resume checks of tests/test_layouts.assert_same_run."""
    workdir = run_layout(tmp_path, data, "moe", 4, ["--ep", "2", "--zero_stage", zero], ["--max_steps", str(STEPS)])
    records = read_metrics(os.path.join(workdir, "m.jsonl"))
    for got, want in zip(records, reference["moe"]):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got["step"], got, want)
    assert_same_run(workdir, data, "moe", reference["moe"])


@pytest.mark.parametrize("flags,needle", [(["--ep", "2", "--use_moe", "0"], "--use_moe 1"),
                                          (["--ep", "2", "--num_experts", "3"], "num_experts=3"),
                                          (["--ep", "4"], "must divide the data-parallel size (2)"),
                                          (["--ep", "2", "--zero_stage", "1"], "--zero_stage 0/2/3")])
def test_bad_ep_is_one_line(flags, needle, data, tmp_path):  # noqa: F811
    args = [*run_args(str(tmp_path), data, "moe", 2), *flags]
    proc = forked(SCRIPT, args, 2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]


# nproc, flags: the 4-process ep = dp case; 8 processes add sequence parallel, expert replicas (dp 4, ep 2: the
# replica group of each tp rank) and FSDP2 on the 2-D dp x tp mesh with the experts left out
EP_TP_LAYOUTS = {"ep2_tp2": (4, []), "ep2_tp2_dp4_sp_zero2": (8, ["--sequence_parallel", "1", "--zero_stage", "2"])}


@pytest.mark.parametrize("layout", list(EP_TP_LAYOUTS))
def test_ep2_tp2_training_run_equals_one_process(layout, data, reference, tmp_path):  # noqa: F811
    """`--ep 2 --tp 2` (ep carved out of dp per tp rank; on 4 processes experts 0-1 on ranks {0,1}, 2-3 on {2,3},
    whole on both tp ranks, ETP=1; attention, dense and shared parts tensor-parallel): every step's loss, aux loss,
    tokens and gradient norm equal the single process's (the norm within the harness's loss bound: the same
    trajectory), and the checkpoint/resume checks of tests/test_layouts.assert_same_run (the gathered weights are the
    run's checkpoint; one process resumed from its step-4 checkpoint takes the layout's last step)."""
    nproc, flags = EP_TP_LAYOUTS[layout]
    workdir = run_layout(tmp_path, data, "moe", nproc, ["--ep", "2", "--tp", "2", *flags], ["--max_steps", str(STEPS)])
    records = read_metrics(os.path.join(workdir, "m.jsonl"))
    for got, want in zip(records, reference["moe"]):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got["step"], got, want)
    assert_same_run(workdir, data, "moe", reference["moe"])
