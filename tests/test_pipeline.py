"""Pipeline parallel (pp=2 on gloo) against the single-process model: loss, gradients, one AdamW step."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import build_pipeline, spawn
from tests.helpers.numerics import assert_adam_first_step_close
from trainer.parallel.pipeline import PipelineLoss as pipeline_loss_fn
from trainer.parallel.pipeline import (
    PipelineStageModule,
    params_for_grad_norm,
    pipeline_stage_ranges,
    pipeline_step,
    pp_validate,
    sync_tied_grads,
)
from trainer.plan.objective import LMObjective

VOCAB, SEQ, BATCH, TOL = 128, 32, 4, 1e-5
LR, ADAM_EPS = 1e-2, 1e-8  # torch's default eps: near-zero grads are handled by the per-element bound


def tiny_model(moe, layers):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=layers, vocab_size=VOCAB, num_attention_heads=4,
                            num_key_value_heads=2, use_moe=moe, num_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.1, tie_word_embeddings=True)
    return MiniMindForCausalLM(config).float()


def make_batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # some positions carry no loss
    labels[2, 20:] = -100
    return input_ids, F.pad(labels[:, 1:], (0, 1), value=-100)


def make_positions(packed):
    """(BATCH, SEQ) position ids: 0..SEQ-1, or packed rows whose documents restart at 0 (a different cut per row)."""
    if not packed:
        return torch.arange(SEQ).expand(BATCH, SEQ)
    rows = []
    for row in range(BATCH):
        cut = 3 + 5 * row  # documents [0, cut) and [cut, SEQ)
        rows.append(torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]))
    return torch.stack(rows)


def assert_close(actual, expected, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff}"


def _pipeline_case(rank, moe, layers, schedule_name, num_microbatches, packed, loss_scale=None):
    model = tiny_model(moe, layers)
    reference = copy.deepcopy(model)  # deepcopy keeps lm_head tied to embed_tokens
    input_ids, targets = make_batch()
    positions = make_positions(packed)
    num_items = (targets != -100).sum()

    out = reference(input_ids, position_ids=positions, shift_labels=targets, num_items_in_batch=num_items)
    (out.loss + out.aux_loss).backward()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    reference_optimizer.step()

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    # fp16's GradScaler: a power of two, so scaled gradients are the unscaled ones times it, exactly
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale) if loss_scale else None
    loss_fn = pipeline_loss_fn(num_items, aux_weight=(BATCH // num_microbatches) / BATCH, scaler=scaler,
                               objective=LMObjective())
    scale = loss_scale or 1.0
    schedule, modules, has_first, has_last = build_pipeline(model, mesh, schedule_name, num_microbatches,
                                                            loss_fn, "cpu", (BATCH // num_microbatches, SEQ))
    assert (has_first, has_last) == (rank == 0, rank == 1)
    calls = []
    for module in modules:
        module.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    losses = pipeline_step(schedule, (input_ids, positions.float()), targets, has_first, has_last)
    # each stage runs once per micro-batch, on real data: no extra first-step shape-inference pass, which
    # torch 2.13 runs on uninitialised inputs (MoE routing on garbage differs between tp ranks and hangs)
    assert len(calls) == num_microbatches * len(modules)
    sync_tied_grads(modules, mesh)

    if has_last:
        assert len(losses) == num_microbatches
        assert_close(torch.stack(losses).sum() / scale, out.loss + out.aux_loss, "total loss")
        ce, aux, _ = loss_fn.pop_step(num_microbatches)
        assert_close(ce, out.loss, "CE part")
        assert_close(aux, out.aux_loss, "aux part")
    names = set()
    for module in modules:
        for name, param in module.named_parameters():
            names.add(name)
            assert_close(param.grad / scale, reference.get_parameter(name).grad, f"grad of {name}")
    for param in {id(p): p for m in modules for p in m.parameters()}.values():
        param.grad /= scale  # what the scaler's unscale_ does next (exact: a power of two)
    everyone = [None, None]
    dist.all_gather_object(everyone, sorted(names))
    assert set().union(*everyone) == set(dict(reference.named_parameters(remove_duplicate=False)))

    unique_params = list({id(p): p for m in modules for p in m.parameters()}.values())
    grads = {name: param.grad.clone() for module in modules for name, param in module.named_parameters()}
    optimizer = torch.optim.AdamW(unique_params, lr=LR, eps=ADAM_EPS)
    optimizer.step()
    for module in modules:  # per-element bound from the measured gradients (tests/helpers/numerics.py)
        for name, param in module.named_parameters():
            ref = reference.get_parameter(name)
            assert_adam_first_step_close(param.detach(), ref.detach(), grads[name], ref.grad, LR, ADAM_EPS,
                                         f"weight {name} after AdamW")


def _pipeline_worker(rank, world_size, moe, cases):
    for schedule_name, num_microbatches, packed, *loss_scale in cases:
        layers = 4 if schedule_name == "interleaved1f1b" else 2
        _pipeline_case(rank, moe, layers, schedule_name, num_microbatches, packed, *loss_scale)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_pipeline_matches_single_process(moe):
    cases = [(s, n, False) for s in ("gpipe", "1f1b", "interleaved1f1b") for n in (4, 2)]
    cases += [("1f1b", 2, True), ("interleaved1f1b", 4, True)]  # --doc_mask: masks rebuilt on every stage
    cases += [("1f1b", 2, False, 2.0 ** 16)]  # fp16: GradScaler's initial scale
    spawn(_pipeline_worker, 2, moe, cases, timeout=100, start_method="fork")


def test_stage_ranges_and_validation():
    assert pipeline_stage_ranges(4, 2) == [(0, 2), (2, 4)]
    assert pipeline_stage_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert pp_validate(4, 2, "1f1b", 2) is None
    assert pp_validate(4, 2, "interleaved1f1b", 4) is None
    assert "layers" in pp_validate(3, 2, "interleaved1f1b", 4)
    assert "layers" in pp_validate(1, 2, "gpipe", 4)
    assert "micro-batches" in pp_validate(4, 2, "1f1b", 1)
    assert "multiple" in pp_validate(8, 2, "interleaved1f1b", 5)
    assert "pp_schedule" in pp_validate(4, 2, "zb", 4)


def test_stage_modules_chain_to_full_model():
    """Without any process group: chained stage modules give the model's logits, names and aux."""
    model = tiny_model(True, 3).eval()
    input_ids, _ = make_batch()
    stages = [PipelineStageModule(model, s, e, s == 0, e == 3) for s, e in pipeline_stage_ranges(3, 2)]
    for positions in (torch.arange(5, 5 + SEQ).expand(BATCH, SEQ), make_positions(packed=True)):  # cp-style, packed
        with torch.no_grad():
            hidden, aux = stages[1](*stages[0](input_ids, positions.float()))
            out = model(input_ids, position_ids=positions)
        assert torch.allclose(hidden, out.logits, atol=1e-6) and torch.allclose(aux, out.aux_loss.reshape(1))
    names = {n for stage in stages for n in dict(stage.named_parameters())}
    assert names == set(dict(model.named_parameters(remove_duplicate=False)))
    assert len(params_for_grad_norm(stages)) == len(list(model.parameters()))  # tied weight counted once
