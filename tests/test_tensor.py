"""Tensor parallel (trainer/parallel/tensor.py) against the single-process model, on CPU gloo.

Every rank builds the same model from the same seed, keeps a plain copy and parallelizes the other,
then compares loss, every gradient, clipped grad norm and one AdamW step.
"""
import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import spawn
from tests.helpers.numerics import assert_adam_first_step_close
from trainer.parallel.tensor import apply_tensor_parallel, tp_loss_context, tp_validate

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=64)
LR, ADAM_EPS = 1e-3, 1e-8  # torch's default eps: the ill-conditioned case the bound is for
MOE = dict(TINY, use_moe=True, num_experts=4, num_experts_per_tok=2, n_shared_experts=1)


def _batch(vocab_size, batch=2, seq_len=32):
    """Same batch on every rank: ids, targets (-100 where no loss), and the step's target count."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    labels = input_ids.clone()
    labels[1, :5] = -100  # a masked prompt
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    return input_ids, shift_labels, (shift_labels != -100).sum()


def _step(model, input_ids, shift_labels, num_items, loss_parallel):
    """Two micro-batches of forward + backward as the trainer runs them, then clipping.

    Returns (loss, aux_loss, full logits, grad norm, last model output).
    """
    losses, auxes, logits = [], [], []
    for rows in (slice(0, 1), slice(1, 2)):  # grads accumulate into the (tied, sharded) parameters
        with tp_loss_context(loss_parallel):
            out = model(input_ids=input_ids[rows], shift_labels=shift_labels[rows], num_items_in_batch=num_items)
            (out.loss + out.aux_loss / 2).backward()
        losses.append(out.loss.detach())
        auxes.append(out.aux_loss.detach())
        logits.append(_full(out.logits.detach()))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # small: clipping is active
    return sum(losses), sum(auxes) / 2, torch.cat(logits), _full(grad_norm), out


def _close(actual, expected, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda default: f"{what}: {default}")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare_tp(rank, world_size, config_kwargs, sequence_parallel, loss_parallel):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    plain = MiniMindForCausalLM(MiniMindConfig(**config_kwargs))
    model = apply_tensor_parallel(copy.deepcopy(plain), mesh, sequence_parallel, loss_parallel)
    where = f"(rank {rank}, moe={config_kwargs.get('use_moe', False)}, sp={sequence_parallel}, lp={loss_parallel})"

    # the tied weight is still one Parameter, sharded over the vocabulary for both uses
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed and embed.placements == (Shard(0),), where
    tp_params, plain_params = dict(model.named_parameters()), dict(plain.named_parameters())
    assert tp_params.keys() == plain_params.keys(), where
    assert all(isinstance(p, DTensor) for p in tp_params.values()), where

    batch = _batch(plain.config.vocab_size)
    ref_loss, ref_aux, ref_logits, ref_norm, _ = _step(plain, *batch, loss_parallel=False)
    loss, aux, logits, norm, out = _step(model, *batch, loss_parallel=loss_parallel)
    assert not isinstance(out.loss, DTensor), where
    if loss_parallel:  # logits never gathered: each rank holds its vocabulary slice
        assert isinstance(out.logits, DTensor) and out.logits.placements == (Shard(2),), where
    _close(loss, ref_loss, f"loss {where}", atol=0)
    _close(aux, ref_aux, f"aux loss {where}", atol=1e-7)
    _close(logits, ref_logits, f"logits {where}")
    _close(norm, ref_norm, f"grad norm {where}", atol=0)
    for name, ref in plain_params.items():
        grad = tp_params[name].grad
        assert grad.placements == tp_params[name].placements, f"{name} grad is {grad.placements} {where}"
        _close(grad.full_tensor(), ref.grad, f"grad {name} {where}")

    grads = {name: _full(p.grad).clone() for name, p in tp_params.items()}
    for m in (plain, model):
        torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1).step()
    # per element, from the measured gradients: Adam's first step amplifies a tiny grad's rounding
    # (tests/helpers/numerics.py)
    tight = total = 0
    for name, ref in plain_params.items():
        bound = assert_adam_first_step_close(_full(tp_params[name].detach()), ref.detach(), grads[name], ref.grad,
                                             LR, ADAM_EPS, f"updated {name} {where}")
        tight, total = tight + int((bound < LR * 1e-4).sum()), total + bound.numel()
    assert tight >= 0.99 * total, f"the update bound is loose on {total - tight} of {total} weights {where}"


def _run_cases(rank, world_size, cases):
    for config_kwargs, sequence_parallel, loss_parallel in cases:
        _compare_tp(rank, world_size, config_kwargs, sequence_parallel, loss_parallel)


def test_tp2_dense_and_moe():
    # one job for all cases: starting a process (torch + transformers imports) costs more than a case
    cases = [(TINY, False, True), (TINY, True, True), (TINY, True, False), (MOE, False, True), (MOE, True, True)]
    spawn(_run_cases, 2, cases, timeout=150, start_method="fork")


def test_tp4_dense():
    config_kwargs = dict(TINY, num_key_value_heads=4)
    spawn(_run_cases, 4, [(config_kwargs, False, True), (config_kwargs, True, True)], timeout=240,
          start_method="fork")


def test_tp_validate():
    config = MiniMindConfig(**TINY)
    assert tp_validate(config, 1) is None and tp_validate(config, 2) is None
    assert "num_key_value_heads" in tp_validate(config, 4)
    assert "vocab_size" in tp_validate(MiniMindConfig(**dict(TINY, vocab_size=511)), 2)
    assert "max_seq_len" in tp_validate(config, 2, seq_len=33) and tp_validate(config, 2, seq_len=32) is None
    assert "moe_intermediate_size" in tp_validate(MiniMindConfig(**dict(MOE, moe_intermediate_size=99)), 2)
