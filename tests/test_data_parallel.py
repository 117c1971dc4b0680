"""trainer/parallel/data.py, clip.py and state_dict.py against the single-process result.

One 2-process gloo job trains a tiny MiniMind 3 AdamW steps (with gradient clipping) under every
data-parallel variant on a global batch of 4 split 2/2; the single-process run on the full batch is
the reference. The same job checks full-state gathering across pipeline stages.
"""
import copy
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import trainer.parallel.state_dict as sd
from tests.helpers.launch import spawn
from tests.helpers.numerics import FP32_EPS, GRAD_ULPS, adamw_f64_step
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.data import (
    apply_data_parallel,
    gradient_sync,
    load_zero,
    place_step_for_kernel,
    validate_data_parallel,
    zero_state_dict,
)
from trainer.parallel.mesh import grad_reduce_factor
from trainer.parallel.state_dict import (
    TIED_EMBEDDING,
    clean_fqn,
    full_model_state_dict,
    load_full_state,
)

# lr 1e-3: Adam divides by sqrt(v), so float reduction-order noise on near-zero grads grows with lr.
STEPS, BATCH, SEQ, VOCAB, LR, MAX_NORM = 3, 4, 32, 128, 1e-3, 0.5
EXACT_VARIANTS = ("ddp", "zero1", "zero2", "zero3")  # the others compress gradients
VARIANTS = {  # name: (zero_stage, grad_compression, apply_data_parallel extras)
    "ddp": (0, "none", {}),
    "ddp_bf16": (0, "bf16", {}),
    "ddp_powersgd_warmup": (0, "powersgd", dict(powersgd_rank=1, powersgd_start_iter=10)),
    "ddp_powersgd": (0, "powersgd", dict(powersgd_rank=1, powersgd_start_iter=2)),
    "zero1": (1, "none", {}),
    "zero2": (2, "none", {}),
    "zero3": (3, "none", {}),
}


def _merge_optim(into, osd, tied_aliases):
    if not osd:
        return
    for k, v in osd["state"].items():
        into["state"].setdefault(k, v)
    for i, group in enumerate(osd["param_groups"]):
        if i == len(into["param_groups"]):
            into["param_groups"].append(dict(group, params=[]))
        into["param_groups"][i]["params"] += [k for k in group["params"] if k not in into["param_groups"][i]["params"]]
    for alias, canonical in (tied_aliases or {}).items():  # keep the shared weight once, as one process does
        if alias in into["state"] and canonical in into["state"]:
            del into["state"][alias]
            for group in into["param_groups"]:
                group["params"] = [k for k in group["params"] if k != alias]


def full_optimizer_state_dict(model_parts, optimizers, pp_group=None, tied_aliases=None):
    """Full fp32 CPU optimizer state keyed by FQN on global rank 0 (None on other ranks): the reference format.

    optimizers: one per model part, or one over all parts. ZeroRedundancyOptimizer (ZeRO-1) is gathered with
    consolidate_state_dict. tied_aliases (e.g. TIED_EMBEDDING when a later pipeline stage keeps a
    copy of the tied embedding): alias entries are dropped in favour of the canonical FQN.
    A collective: every rank must call it.
    """
    options = sd._full_options(pp_group)
    local = {"state": {}, "param_groups": []}
    for part, optim in sd._optimizer_pairs(model_parts, optimizers):
        if isinstance(optim, ZeroRedundancyOptimizer):
            osd = zero_state_dict(part, optim)
        else:
            osd = get_optimizer_state_dict(part, optim, options=options)
        _merge_optim(local, sd._cpu_fp32(osd), tied_aliases)
    stages = sd._gather_pp(local, pp_group)
    if not sd.is_main_process():
        return None
    merged = {"state": {}, "param_groups": []}
    for stage in stages:
        _merge_optim(merged, stage, tied_aliases)
    return merged


def make_model():
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=VOCAB, max_position_embeddings=SEQ)
    return MiniMindForCausalLM(config)


def make_batches():
    """STEPS global batches (input_ids, labels); some labels masked so ranks hold unequal token counts."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :7] = -100
        labels[3, 20:] = -100
        batches.append((ids, labels))
    return batches


def num_items(labels):
    return int((labels[:, 1:] != -100).sum())  # targets = labels shifted left, -100 appended


def train_reference():
    """Single process, full batch: weights, optimizer state and grad norms after STEPS steps."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for ids, labels in make_batches():
        model(ids, labels=labels, num_items_in_batch=num_items(labels)).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, norms


def _wrap_variant(dims, zero_stage, compression, extras):
    from trainer.parallel.data import apply_data_parallel, data_parallel_optimizer
    model = apply_data_parallel(make_model(), dims.mesh("dp_cp"), zero_stage, compression, **extras)
    return model, data_parallel_optimizer(model.parameters(), LR, zero_stage, dims.group("dp_cp"))


def _full_grads(model):
    """Every parameter's gradient as a full tensor keyed by FQN (FSDP2's sharded DTensors gathered: a collective)."""
    return {clean_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _train_variant(dims, zero_stage, compression, extras, record=False):
    """Train STEPS steps; with `record`, also the weights before each step and its clipped gradients."""
    model, optimizer = _wrap_variant(dims, zero_stage, compression, extras)
    factor = dims.size("dp") * dims.size("cp")  # the ranks a gradient is averaged over
    norms, first_grads, history = [], None, []
    for ids, labels in make_batches():
        before = full_model_state_dict(model) if record else None  # a collective; a dict on rank 0 only
        if before is not None:  # a copy: on CPU, DDP's state dict holds the live parameters the step changes
            before = {k: v.clone() for k, v in before.items()}
        rows = slice(dims.rank("dp"), None, dims.size("dp"))  # DistributedSampler: rank r takes r::dp
        out = model(ids[rows], labels=labels[rows], num_items_in_batch=num_items(labels))
        (out.loss * factor).backward()
        if first_grads is None and zero_stage == 0:  # DDP grads are full tensors
            first_grads = {clean_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        if record:
            history.append((before, _full_grads(model)))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, norms, first_grads, history


def _stage_parts(model, rank):
    """A hand split into two pipeline stages with the full model's FQNs; the last keeps a tied copy."""
    part = nn.Module()
    part.model = nn.Module()
    part.model.layers = nn.ModuleDict({str(rank): model.model.layers[rank]})
    if rank == 0:
        part.model.embed_tokens = model.model.embed_tokens
    else:
        part.model.norm = model.model.norm
        part.lm_head = nn.Linear(64, VOCAB, bias=False)  # its own copy of the tied weight
    return part


def _dp_worker(rank, world_size, ref_path, out_path):
    from trainer.parallel.mesh import ParallelDims
    dims = ParallelDims.build(world_size, device_type="cpu")
    results = {}
    for name, (zero_stage, compression, extras) in VARIANTS.items():
        model, optimizer, norms, first_grads, history = _train_variant(dims, zero_stage, compression, extras,
                                                                       record=name in EXACT_VARIANTS)
        model_sd = full_model_state_dict(model)
        optim_sd = full_optimizer_state_dict(model, optimizer)
        if zero_stage in (1, 3):  # round trip into a fresh model of the same layout, gathered again
            fresh, fresh_opt = _wrap_variant(dims, zero_stage, compression, extras)
            load_full_state(fresh, fresh_opt, _bcast(model_sd), _bcast(optim_sd))
            results[name + "_reloaded"] = (full_model_state_dict(fresh), full_optimizer_state_dict(fresh, fresh_opt))
        results[name] = (model_sd, optim_sd, norms)
        results[name + "_grads"] = first_grads
        results[name + "_history"] = history

    # Pipeline-style gather: the world acts as a pp group of 2 stages holding the reference state.
    ref = torch.load(ref_path)
    part = _stage_parts(make_model(), rank)
    optimizer = torch.optim.AdamW(part.parameters(), lr=LR)
    load_full_state(part, optimizer, ref["model"], ref["optim"], tied_aliases=TIED_EMBEDDING)
    results["pp_gather"] = (full_model_state_dict(part, pp_group=dist.group.WORLD),
                            full_optimizer_state_dict(part, optimizer, pp_group=dist.group.WORLD,
                                                      tied_aliases=TIED_EMBEDDING))
    for fqn, p in part.named_parameters():
        p.grad = ref["grads"][TIED_EMBEDDING.get(fqn, fqn)].clone()
    tied_copy = [part.lm_head.weight] if rank == 1 else []
    norm = clip_grad_norm_(part.parameters(), MAX_NORM, pp_group=dist.group.WORLD, exclude=tied_copy)
    clipped = [None] * world_size if rank == 0 else None
    dist.gather_object((float(norm), {fqn: p.grad for fqn, p in part.named_parameters()}), clipped, dst=0)
    if rank == 0:
        results.update({f"pp_clip{r}": c for r, c in enumerate(clipped)})
        torch.save(results, out_path)


def _bcast(obj):
    """Give every rank rank 0's object (load_full_state takes the whole dict on every rank)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    model, optimizer, norms = train_reference()
    ids, labels = make_batches()[0]
    model(ids, labels=labels, num_items_in_batch=num_items(labels)).loss.backward()
    grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
    fresh = make_model()
    fresh(ids, labels=labels, num_items_in_batch=num_items(labels)).loss.backward()
    first_grads = {fqn: p.grad.clone() for fqn, p in fresh.named_parameters()}
    ref = {"model": full_model_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer),
           "norms": norms, "grads": grads, "first_grads": first_grads}
    torch.save(ref, tmp / "ref.pt")
    spawn(_dp_worker, 2, str(tmp / "ref.pt"), str(tmp / "dp.pt"), timeout=240, start_method="fork")
    return ref, torch.load(tmp / "dp.pt")


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _optim_tensors(osd):
    return {(fqn, key): v for fqn, s in osd["state"].items() for key, v in s.items()}


def _reference_step(weights, step):
    """Single process, full batch `step`, from `weights`: clipped gradients by FQN and the pre-clip norm."""
    model = make_model()
    model.load_state_dict(weights)
    ids, labels = make_batches()[step]
    model(ids, labels=labels, num_items_in_batch=num_items(labels)).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return {fqn: p.grad for fqn, p in model.named_parameters()}, float(norm)


@pytest.mark.parametrize("name", EXACT_VARIANTS)
def test_each_step_matches_single_process(runs, name):
    """Every step of the variant is the single-process step, compared where that is well-conditioned.

    Two AdamW trajectories are not: a near-zero gradient's last-bit rounding flips lr * g / (|g| + eps), and the
    flip differs with the CPU's kernels (tests/helpers/numerics.py). So per step: (1) the variant's clipped gradients
    and
    norm equal the single process's from the variant's own weights (only the reduction order differs), and (2) its
    weights after the step equal float64 AdamW applied to its own gradients, within fp32 rounding. Together
    they are the single-process run, step by step; the final optimizer state is float64 AdamW's as well."""
    ref, dp = runs
    model_sd, optim_sd, norms = dp[name]
    history = dp[name + "_history"]
    assert len(history) == STEPS and all(history[0][0][k].equal(v) for k, v in make_model().state_dict().items())
    afters = [before for before, _ in history[1:]] + [model_sd]
    states = {}
    for step, ((before, grads), after) in enumerate(zip(history, afters)):
        ref_grads, ref_norm = _reference_step(before, step)
        assert ref_norm > MAX_NORM  # clipping is active in every step
        assert norms[step] == pytest.approx(ref_norm, rel=GRAD_ULPS * FP32_EPS)
        assert grads.keys() == ref_grads.keys()
        for fqn, want in ref_grads.items():
            diff, tol = float((grads[fqn] - want).abs().max()), GRAD_ULPS * FP32_EPS * float(want.abs().max())
            assert diff <= tol, (name, step + 1, fqn, diff, tol)
            expected, bound = adamw_f64_step(before[fqn], grads[fqn], states.setdefault(fqn, {}), LR)
            excess = (after[fqn].double() - expected).abs() - bound
            assert excess.max() <= 0, (name, step + 1, fqn, float(excess.max()), float(bound.max()))
    assert model_sd["lm_head.weight"].equal(model_sd["model.embed_tokens.weight"])
    for fqn, state in states.items():
        got = optim_sd["state"][fqn]
        assert float(got["step"]) == STEPS
        assert ((got["exp_avg"].double() - state["exp_avg"]).abs() <= 4 * STEPS * FP32_EPS * state["abs_avg"]).all()
        assert ((got["exp_avg_sq"].double() - state["exp_avg_sq"]).abs()
                <= (2 * STEPS + 4) * FP32_EPS * state["exp_avg_sq"]).all(), fqn
    assert [g["params"] for g in optim_sd["param_groups"]] == [g["params"] for g in ref["optim"]["param_groups"]]


def test_ddp_gradients_match_single_process(runs):
    ref, dp = runs
    assert _max_diff(dp["ddp_grads"], ref["first_grads"]) < 1e-7


def test_bf16_compression_close_to_fp32(runs):
    ref, dp = runs
    fp32, bf16 = ref["first_grads"], dp["ddp_bf16_grads"]
    assert _max_diff(bf16, fp32) > 0  # the hook really compressed
    for fqn, g in fp32.items():  # bf16 keeps 8 significant bits: error within 2^-7 of the tensor's scale
        assert float((bf16[fqn] - g).abs().max()) <= 2 ** -7 * float(g.abs().max()), fqn
    assert dp["ddp_bf16"][2] == pytest.approx(dp["ddp"][2], rel=2 ** -7)


def test_powersgd_warmup_is_exact_then_compresses(runs):
    ref, dp = runs
    warmup, plain, active = dp["ddp_powersgd_warmup"][0], dp["ddp"][0], dp["ddp_powersgd"][0]
    assert all(warmup[k].equal(plain[k]) for k in plain)  # start_powerSGD_iter > steps: plain all-reduce
    diff = _max_diff(active, plain)
    assert 0 < diff and all(torch.isfinite(v).all() for v in active.values())
    assert dp["ddp_powersgd"][2][0] == pytest.approx(dp["ddp"][2][0], rel=1e-6)  # step 1 still uncompressed


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_reload_into_same_layout_round_trips(runs, name):
    _, dp = runs
    model_sd, optim_sd, _ = dp[name]
    reloaded_model, reloaded_optim = dp[name + "_reloaded"]
    assert all(reloaded_model[k].equal(v) for k, v in model_sd.items())
    a, b = _optim_tensors(reloaded_optim), _optim_tensors(optim_sd)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_zero3_state_loads_into_plain_model(runs):
    """Full state saved by the zero-3 run resumes a plain single-process model + AdamW."""
    ref, dp = runs
    model_sd, optim_sd = copy.deepcopy(dp["zero3"][:2])  # the optimizer may keep the loaded tensors
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    load_full_state(model, optimizer, model_sd, optim_sd)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(model.state_dict()[k].equal(v) for k, v in model_sd.items())
    for fqn, p in model.named_parameters():
        for key, v in optim_sd["state"][fqn].items():
            assert optimizer.state[p][key].equal(v)
    # The next step is AdamW's from the loaded state: step count, moments and hyperparameters all came back.
    before = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    optim_sd = copy.deepcopy(optim_sd)  # the optimizer steps the loaded tensors in place
    ids, labels = make_batches()[0]
    model(ids, labels=labels).loss.backward()
    optimizer.step()
    for fqn, p in model.named_parameters():
        saved = optim_sd["state"][fqn]
        state = dict(step=int(saved["step"]), exp_avg=saved["exp_avg"].double(),
                     # the one new step rounds against these
                     exp_avg_sq=saved["exp_avg_sq"].double(), abs_avg=saved["exp_avg"].double().abs())
        expected, bound = adamw_f64_step(before[fqn], p.grad, state, LR)
        assert ((p.detach().double() - expected).abs() <= bound).all(), fqn


def test_pipeline_gather_and_clip(runs):
    ref, dp = runs
    model_sd, optim_sd = dp["pp_gather"]
    assert model_sd.keys() == ref["model"].keys() and all(model_sd[k].equal(v) for k, v in ref["model"].items())
    assert _optim_tensors(optim_sd).keys() == _optim_tensors(ref["optim"]).keys()
    assert all(v.equal(_optim_tensors(ref["optim"])[k]) for k, v in _optim_tensors(optim_sd).items())
    # Clip across two stages, the tied copy counted once, equals torch's on the whole model.
    grads = {k: g.clone() for k, g in ref["grads"].items()}
    model = make_model()
    for fqn, p in model.named_parameters():
        p.grad = grads[fqn]
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    for rank in (0, 1):
        norm, clipped = dp[f"pp_clip{rank}"]
        assert norm == pytest.approx(float(expected), rel=1e-6)
        for fqn, g in clipped.items():
            assert torch.allclose(g, grads[TIED_EMBEDDING.get(fqn, fqn)], rtol=1e-6, atol=1e-9)


def test_one_optimizer_over_two_parts():
    """Interleaved pipelines hold several parts and one optimizer: state still keyed by full FQNs."""
    model, optimizer, _ = train_reference()
    expected = full_optimizer_state_dict(model, optimizer)
    part_a, part_b = nn.Module(), nn.Module()
    part_a.model, part_b.model = nn.Module(), nn.Module()
    part_a.model.embed_tokens = model.model.embed_tokens
    part_a.model.layers = nn.ModuleDict({"0": model.model.layers[0]})
    part_b.model.layers = nn.ModuleDict({"1": model.model.layers[1]})
    part_b.model.norm, part_b.lm_head = model.model.norm, model.lm_head
    got = full_optimizer_state_dict([part_a, part_b], [optimizer])
    assert _optim_tensors(got).keys() == _optim_tensors(expected).keys()
    fresh = torch.optim.AdamW(model.parameters(), lr=LR)
    load_full_state([part_a, part_b], [fresh], None, got)
    assert all(fresh.state[p]["exp_avg"].equal(optimizer.state[p]["exp_avg"]) for p in model.parameters())


def test_clip_plain_matches_torch():
    model = make_model()
    ids, labels = make_batches()[0]
    model(ids, labels=labels).loss.backward()
    twin = copy.deepcopy(model)
    for a, b in zip(model.parameters(), twin.parameters()):
        b.grad = a.grad.clone()
    for max_norm in (1e-3, 1e3):
        norm = clip_grad_norm_(model.parameters(), max_norm)
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
        assert float(norm) == pytest.approx(float(expected), rel=1e-6)
        assert all(torch.allclose(a.grad, b.grad, rtol=1e-6) for a, b in zip(model.parameters(), twin.parameters()))
    inf_norm = clip_grad_norm_(model.parameters(), 1.0, norm_type=math.inf)
    assert float(inf_norm) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0, math.inf)))


def test_clip_norm_is_exact_on_a_large_cpu_gradient():
    """An embedding-shaped gradient, a few heavy rows then many light ones (as a batch's tokens make it): torch's CPU
    norm kernel accumulates in one fp32 register (pytorch#169237; 2e-5 off here, 1.3e-4 on a real 6400x64 one), so
    the clip would overshoot and layouts would disagree. Ours sums each row's squares in fp32 and the rows in
    float64: within 2 ulp."""
    torch.manual_seed(0)
    grad = torch.randn(6400, 64) * 1e-5
    grad[:150] = torch.randn(150, 64) * 1e-2
    exact = float(grad.double().norm())
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    norm = clip_grad_norm_([param], 0.5 * exact)
    assert float(norm) == pytest.approx(exact, rel=2 * FP32_EPS)
    assert float(param.grad.double().norm()) <= 0.5 * exact * (1 + 2 * FP32_EPS)  # clipped to max_norm, not past it


def test_validate_data_parallel():
    assert validate_data_parallel(0, "none") is None
    assert validate_data_parallel(3, "none", dp=2, tp=2) is None
    assert "0, 1, 2, 3" in validate_data_parallel(4, "none")
    assert "none, bf16, powersgd" in validate_data_parallel(0, "fp8")
    assert "--zero_stage 0 or 1" in validate_data_parallel(2, "powersgd")
    assert "use --zero_stage 2 or 3" in validate_data_parallel(1, "none", dp=2, tp=2)
    # the ranks a gradient is averaged over: dp x cp; the model dimensions leave it alone
    assert grad_reduce_factor(SimpleNamespace(dp=2, cp=2, tp=3, pp=5, ep=7)) == 4


def _adam_state(model, step):
    """An FQN-keyed AdamW state as a checkpoint holds it (step on the CPU, as every saved 0-dim tensor)."""
    g = torch.Generator().manual_seed(2)
    state = {n: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(p.shape, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-6} for n, p in model.named_parameters()}
    group = dict(torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LR).param_groups[0])
    return {"state": state, "param_groups": [dict(group, params=list(state))]}


def _zero_fused_load_worker(rank, world_size, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(device)
    twin = copy.deepcopy(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, foreach=False)
    saved = _adam_state(model, step=5)
    load_zero(model, zero, saved)
    for p in model.parameters():  # where the fused kernel reads it: the parameter's device, fp32
        step = zero.optim.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32 and float(step) == 5
    ref.load_state_dict({"state": {i: s for i, s in enumerate(copy.deepcopy(saved)["state"].values())},
                         "param_groups": [dict(saved["param_groups"][0], params=list(range(4)))]})
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.full_like(p, 1e-3)
        q.grad = p.grad.clone()
    zero.step()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):  # fused vs single-tensor fp32: a few ulp of lr and |w|
        assert torch.allclose(p, q, rtol=8 * FP32_EPS, atol=8 * FP32_EPS * LR)


def test_zero1_fused_adamw_resumes_with_step_beside_params():
    """ZeroRedundancyOptimizer.load_state_dict moves `step` to the CPU (pytorch#124133); fused AdamW needs it
    beside the params. The reloaded fused step equals plain AdamW's on the same state."""
    spawn(_zero_fused_load_worker, 1, "cpu", start_method="fork")  # CPU: forked, no fresh torch import


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero1_fused_adamw_resumes_on_cuda():
    spawn(_zero_fused_load_worker, 1, "cuda")


def test_place_step_for_kernel_leaves_default_kernels_alone():
    param = nn.Parameter(torch.ones(3))
    for fused, dtype in ((False, torch.float64), (True, torch.float32)):  # default kernel; fused already in place
        optim = torch.optim.AdamW([param], lr=LR, fused=fused)
        step = torch.tensor(4.0, dtype=dtype)
        optim.state[param] = {"step": step}
        place_step_for_kernel(optim)
        assert optim.state[param]["step"] is step
    optim.state[param] = {"step": torch.tensor(4.0, dtype=torch.float64)}
    optim.param_groups[0]["fused"] = True
    place_step_for_kernel(optim)
    assert optim.state[param]["step"].dtype == torch.float32


ACCUMULATION = 4  # micro-batches of one row per rank: a global batch of 2 * ACCUMULATION rows


def _accumulation_batch():
    ids = torch.randint(1, VOCAB, (2 * ACCUMULATION, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[1, :9] = -100
    return ids, labels


def _count_calls(names, calls, kind):
    """Wrap the dist functions `names` (those this torch has) to append `kind` to `calls` on each call."""
    for name in names:
        if hasattr(dist, name):
            real = getattr(dist, name)
            setattr(dist, name, lambda *a, _real=real, **k: calls.append(kind) or _real(*a, **k))


def _accumulation_worker(rank, world_size, out_path):
    from trainer.parallel.mesh import ParallelDims
    dims = ParallelDims.build(world_size, device_type="cpu")
    ids, labels = _accumulation_batch()
    calls = []
    # FSDP2 calls the first of each pair in 2.11, the second later
    _count_calls(("reduce_scatter_tensor", "reduce_scatter_single"), calls, "reduce_scatter")
    _count_calls(("all_gather_into_tensor", "all_gather_single"), calls, "all_gather")
    results = {}
    for zero_stage in (0, 2, 3):
        model = apply_data_parallel(make_model(), dims.mesh("dp_cp"), zero_stage)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = []
        for step in range(2):  # the second step's forwards must gather the updated shards again
            calls.clear()
            for i in range(ACCUMULATION):
                row = slice(2 * i + rank, 2 * i + rank + 1)
                with gradient_sync(model, enabled=i == ACCUMULATION - 1):
                    out = model(ids[row], labels=labels[row], num_items_in_batch=num_items(labels))
                    (out.loss * dims.size("dp")).backward()
            counts.append((calls.count("reduce_scatter"), calls.count("all_gather")))
            if step == 0:
                grads = _full_grads(model)
                optimizer.step()
                optimizer.zero_grad()
        results[zero_stage] = (counts, grads)
    if rank == 0:
        torch.save(results, out_path)


def test_fsdp_reduces_gradients_once_per_accumulated_step(tmp_path):
    """Accumulating 4 micro-batches under gradient_sync: DDP and FSDP2 (ZeRO-2, ZeRO-3) reduce once, on the last,
    one reduce-scatter per FSDP unit (each decoder block and the root), and the gradients are the single process's
    on the whole batch (only the reduction order differs). ZeRO-2 gathers each unit once per step (parameters stay
    gathered across micro-batches, resharded after the last backward); ZeRO-3 gathers every block twice per
    micro-batch (forward, backward) and the root once (kept gathered from forward to backward, FSDP2's root default)."""
    spawn(_accumulation_worker, 2, str(tmp_path / "acc.pt"), timeout=240, start_method="fork")
    results = torch.load(tmp_path / "acc.pt")
    model = make_model()
    ids, labels = _accumulation_batch()
    model(ids, labels=labels, num_items_in_batch=num_items(labels)).loss.backward()
    layers = model.config.num_hidden_layers
    units = layers + 1
    all_gathers = {0: 0, 2: units, 3: ACCUMULATION * (2 * layers + 1)}  # DDP broadcasts/all-reduces in C++
    for zero_stage, (counts, grads) in results.items():
        for reduce_scatters, gathers in counts:  # the same on both optimizer steps
            assert reduce_scatters == (0 if zero_stage == 0 else units), zero_stage
            assert gathers == all_gathers[zero_stage], (zero_stage, gathers)
        for fqn, p in model.named_parameters():
            diff, tol = float((grads[fqn] - p.grad).abs().max()), GRAD_ULPS * FP32_EPS * float(p.grad.abs().max())
            assert diff <= tol, (zero_stage, fqn, diff, tol)


def _fp16_found_inf_worker(rank, world_size, out_path):
    """Each rank owns different parameters (as a pipeline stage does); only rank 0's fp16 backward overflows."""
    from trainer.runtime.step_guard import StepGuard, scaler_found_inf
    torch.manual_seed(rank)
    model = nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    # rank 0: 4 rows of 1e3 times the scale 2^10 sum to ~4e6 in the fp16 weight gradient (> 65504: inf)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)) * (1e3 if rank == 0 else 1.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    local_inf = float(sum(scaler_found_inf(scaler, optimizer)))
    StepGuard(max_bad_steps=3).check(loss.detach(), 0.0, False, "cpu", scaler_found_inf(scaler, optimizer))
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    results = [None, None]
    dist.all_gather_object(results, (local_inf, unchanged, scaler.get_scale()))
    if rank == 0:
        torch.save(results, out_path)


def test_fp16_scaler_skips_on_every_rank_when_one_overflows(tmp_path):
    """Sharded gradients: each rank's GradScaler sees only its own; the guard's all-reduce makes every rank skip the
    step and halve the scale (GradScaler's backoff 0.5) when one rank's fp16 gradient overflowed."""
    spawn(_fp16_found_inf_worker, 2, str(tmp_path / "inf.pt"), timeout=120, start_method="fork")
    (inf0, unchanged0, scale0), (inf1, unchanged1, scale1) = torch.load(tmp_path / "inf.pt")
    assert (inf0, inf1) == (1.0, 0.0)  # the overflow is rank 0's alone
    assert unchanged0 and unchanged1
    assert scale0 == scale1 == 2.0 ** 9


class _OutOfOrder(nn.Module):
    """Linear layers used in another order than registered: DDP's second bucket layout (the order gradients became
    ready) differs from its first (registration order reversed)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(6))

    def forward(self, x):
        for i in (2, 0, 5, 3, 1, 4):
            x = torch.tanh(self.layers[i](x))
        return x


def _powersgd_resume_worker(rank, world_size, out_path):
    """Six steps of DDP + PowerSGD (start at 2, 64 KiB buckets: several, laid out anew after the first backward); the
    same six steps as three, then a new DDP and hook that load the model and the hook's state_dict(), then three;
    and the three without the hook's state. Each step's reduced gradients, per run."""
    from torch.nn.parallel import DistributedDataParallel

    from trainer.parallel.powersgd import ResumablePowerSGD

    def build(weights=None, hook_state=None):
        torch.manual_seed(0)
        model = _OutOfOrder()
        if weights is not None:
            model.load_state_dict(weights)
        ddp = DistributedDataParallel(model, bucket_cap_mb=1 / 16)
        hook = ResumablePowerSGD(None, 2, 2, {id(p): n for n, p in model.named_parameters()})
        if hook_state is not None:
            hook.load_state_dict(hook_state)
        ddp.register_comm_hook(hook.state, hook.hook)
        return ddp, hook

    def train(ddp, steps):
        grads = []
        for step in steps:
            x = torch.randn(8, 128, generator=torch.Generator().manual_seed(100 * step + rank))
            ddp.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            grads.append([p.grad.clone() for p in ddp.parameters()])
            with torch.no_grad():
                for p in ddp.parameters():
                    p -= 0.5 * p.grad
        return grads

    whole = train(build()[0], range(1, 7))
    first, hook = build()
    split = train(first, range(1, 4))
    weights, saved = first.module.state_dict(), hook.state_dict()
    buckets = len(hook.layouts)
    split += train(build(weights, saved)[0], range(4, 7))
    fresh = train(build(weights)[0], range(4, 7))
    same = all(torch.equal(a, b) for s, t in zip(whole, split) for a, b in zip(s, t))
    differs = any(not torch.equal(a, b) for s, t in zip(whole[3:], fresh) for a, b in zip(s, t))
    results = [None] * world_size
    dist.all_gather_object(results, (same, differs, buckets, sorted(saved["pieces"]) == sorted(
        n for n, _ in first.module.named_parameters()), saved["iter"]))
    if rank == 0:
        torch.save(results, out_path)


def test_powersgd_state_resumes_across_bucket_layouts(tmp_path):
    """torch's PowerSGD keys its residuals and Qs by bucket index, and DDP's buckets hold other parameters in a new
    process and again after its first backward: the saved state, per parameter, continues bitwise (every step's
    reduced gradients equal the uninterrupted run's); without it the resumed steps differ."""
    spawn(_powersgd_resume_worker, 2, str(tmp_path / "r.pt"), timeout=120, start_method="fork")
    for same, differs, buckets, every_parameter, steps in torch.load(tmp_path / "r.pt"):
        assert same and differs and buckets > 1 and every_parameter and steps == 3


def test_powersgd_flags_reach_the_hook(tmp_path):
    """The real trainer, dp 2: --powersgd_start_step 2 all-reduces steps 1-2 exactly (the plain DDP run's gradient
    norms), compresses from step 3 on; --powersgd_rank 1 and 2 compress differently."""
    from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
    data = demo_slice(tmp_path, "pretrain", 64)
    norms = {}
    for name, extra in (("plain", []), ("rank1", ["--grad_compression", "powersgd", "--powersgd_start_step", "2"]),
                        ("rank2", ["--grad_compression", "powersgd", "--powersgd_start_step", "2",
                                   "--powersgd_rank", "2"])):
        out = tmp_path / name
        proc = forked("trainer/train_pretrain.py", [
            *TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
            "--max_steps", "3", "--log_interval", "1", "--learning_rate", "1e-2", "--save_dir", str(out),
            "--checkpoint_dir", str(out / "ckpt"), *extra], nproc=2, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        norms[name] = [r["grad_norm"] for r in read_metrics(str(out / "pretrain_64_metrics.jsonl"))]
    for name in ("rank1", "rank2"):
        assert norms[name][:2] == pytest.approx(norms["plain"][:2], rel=1e-6)  # the warm-up: exact all-reduce
        assert abs(norms[name][2] - norms["plain"][2]) > 1e-3 * norms["plain"][2]  # compressed
    assert abs(norms["rank1"][2] - norms["rank2"][2]) > 1e-3 * norms["plain"][2]  # another approximation rank


def test_powersgd_resumes_exactly_after_a_kill(tmp_path):
    """The real trainer, dp 2, --powersgd_start_step 2: killed after step 4 (checkpoints every 2 steps), resumed from
    step 4 in new processes, whose DDP lays its buckets out anew and again after their first backward. Steps 5-8
    (compressed, with the residuals and Qs of step 4) equal the uninterrupted run's, loss and gradient norm, bitwise;
    a resume without the saved state (torch's hook alone: zero residuals, new random Qs) differs."""
    from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
    data = demo_slice(tmp_path, "pretrain", 64)

    def args(name):
        out = tmp_path / name
        return [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps",
                "2", "--max_steps", "8", "--log_interval", "1", "--learning_rate", "1e-2", "--save_interval", "2",
                "--grad_compression", "powersgd", "--powersgd_start_step", "2", "--save_dir", str(out),
                "--checkpoint_dir", str(out / "ckpt"), "--metrics_file", str(out / "m.jsonl")]
    whole = forked("trainer/train_pretrain.py", args("whole"), nproc=2, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = forked("tests/helpers/fault_entry.py", args("split"), nproc=2, timeout=300,
                    env={"MINIMIND_TEST_KILL_AT_STEP": "5", "MINIMIND_TEST_KILL_RANK": "1"})
    assert killed.returncode != 0 and "SIGKILL rank 1 at step 5" in killed.stdout + killed.stderr
    assert sorted(os.listdir(tmp_path / "split" / "ckpt" / "pretrain_64")) == ["step_2", "step_4"]
    resumed = forked("trainer/train_pretrain.py", [*args("split"), "--from_resume", "1"], nproc=2, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = (read_metrics(str(tmp_path / name / "m.jsonl")) for name in ("whole", "split"))
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
