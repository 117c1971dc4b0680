"""trainer/trainer_utils.py: MiniMind's cosine schedule, the resume batch sampler and lm_checkpoint."""
import argparse
import math

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL
from tests.helpers.minimind_order import MiniMindOrder, batches, cosine_lr
from trainer.core.build import build_trainer, setup
from trainer.core.loop import train_step
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.trainer_utils import SkipBatchSampler, get_lr, lm_checkpoint


def test_get_lr_matches_minimind_cosine():
    lr, total = 1e-3, 100
    assert get_lr(0, total, lr) == pytest.approx(lr * (0.1 + 0.45 * 2))
    assert get_lr(50, total, lr) == pytest.approx(lr * 0.55)
    assert get_lr(100, total, lr) == pytest.approx(lr * 0.1)
    # warm-up: linear to lr, then the cosine over the remaining steps
    assert get_lr(0, total, lr, warmup_steps=10) == pytest.approx(lr * 0.1)
    assert get_lr(9, total, lr, warmup_steps=10) == pytest.approx(lr)
    assert get_lr(55, total, lr, warmup_steps=10) == pytest.approx(lr * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))))


def test_skip_batch_sampler_skips_and_drops_partial():
    sampler = list(range(11))
    assert list(SkipBatchSampler(sampler, 3)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(SkipBatchSampler(sampler, 3, skip_batches=2)) == [[6, 7, 8]]
    assert len(SkipBatchSampler(sampler, 3, skip_batches=2)) == 1
    assert list(SkipBatchSampler(sampler, 3, skip_batches=5)) == []


# ----------------------------------------------------------------------------- lm_checkpoint
def tiny_config(**kw):
    return MiniMindConfig(**dict(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2), **kw))


def trained(config, steps=2, lr=1e-2):
    """Our model from the seeded init after `steps` AdamW steps, as MiniMind's scripts build model and optimizer."""
    torch.manual_seed(3)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    for ids in batches(config, steps, seed=1):
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def assert_same(a, b, where=""):
    """Nested dicts/lists of tensors and plain values equal, tensors bitwise."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("use_moe", [0, 1], ids=["dense", "moe"])
def test_lm_checkpoint_save_then_load_round_trips(tmp_path, use_moe):
    config = tiny_config(use_moe=bool(use_moe), num_experts=2)
    model, optimizer = trained(config)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stem = "pretrain_64" + ("_moe" if use_moe else "")
    assert lm_checkpoint(config, weight="pretrain", save_dir=str(tmp_path)) is None  # nothing saved yet
    lm_checkpoint(config, weight="pretrain", model=model, optimizer=optimizer, epoch=1, step=7, save_dir=str(tmp_path),
                  scaler=scaler, note="kept")
    loaded = lm_checkpoint(config, weight="pretrain", save_dir=str(tmp_path))
    fp16 = {k: v.half() for k, v in model.state_dict().items()}
    assert_same(loaded, dict(model=fp16, optimizer=optimizer.state_dict(), epoch=1, step=7, world_size=1,
                             wandb_id=None, scaler=scaler.state_dict(), note="kept"))
    assert_same(torch.load(tmp_path / f"{stem}.pth"), fp16)  # MiniMind's weights file beside it, with our sidecar
    assert (tmp_path / f"{stem}.json").is_file()
    # the file itself is MiniMind's: moment i belongs to parameter i of MiniMind's model.parameters()
    raw = torch.load(tmp_path / f"{stem}_resume.pth")
    params = dict(model.named_parameters())
    for index, name in enumerate(name for name, _ in MiniMindOrder(config).named_parameters()):
        assert torch.equal(raw["optimizer"]["state"][index]["exp_avg"], optimizer.state[params[name]]["exp_avg"])
    # a fresh optimizer over a fresh model's parameters takes the loaded state as MiniMind's scripts pass it
    fresh = torch.optim.AdamW(MiniMindForCausalLM(config).parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert_same(fresh.state_dict(), optimizer.state_dict())


def test_lm_checkpoint_load_rescales_step_to_this_world_size(tmp_path):
    """MiniMind's rule: step 5 saved by 2 processes is step 10 for one."""
    config = tiny_config()
    model, optimizer = trained(config, steps=1)
    lm_checkpoint(config, weight="sft", model=model, optimizer=optimizer, step=5, save_dir=str(tmp_path))
    raw = torch.load(tmp_path / "sft_64_resume.pth")
    torch.save(dict(raw, world_size=2), tmp_path / "sft_64_resume.pth")
    assert lm_checkpoint(config, weight="sft", save_dir=str(tmp_path))["step"] == 10


def test_a_file_written_by_lm_checkpoint_resumes_in_the_trainer_exactly(tmp_path):
    """MiniMind-style code saves with lm_checkpoint at step 5; the trainer's --from_resume 1 first step equals that
    code's own next step after lm_checkpoint's load (same fp16 weights, same moments, same batch and lr)."""
    flags = [*TINY_MODEL, "--batch_size", "2", "--accumulation_steps", "1", "--max_seq_len", "16",
             "--learning_rate", "1e-2", "--from_resume", "1", "--save_dir", str(tmp_path / "out"),
             "--checkpoint_dir", str(tmp_path / "ckpt")]
    args = add_train_args(argparse.ArgumentParser()).parse_args(flags)
    planned = resolve(args, 1)  # the config and checkpoint folder; the file exists before the run starts
    model, optimizer = trained(planned.model.config, steps=3)
    lm_checkpoint(planned.model.config, weight="pretrain", model=model, optimizer=optimizer, epoch=0, step=5,
                  save_dir=planned.io.checkpoint_dir)
    plan, dims = setup(args)
    config = plan.model.config
    trainer = build_trainer(plan, dims, 20)
    assert trainer.progress.global_step == 5
    (input_ids,) = batches(config, 1, seed=9)
    metrics = train_step(trainer, [(input_ids, input_ids.clone())])
    lr = cosine_lr(1e-2, 5, 20)
    assert metrics["lr"] == pytest.approx(lr, rel=1e-12)
    # MiniMind's train script after lm_checkpoint's load: weights, optimizer, one step with its lr and clip
    ckp = lm_checkpoint(config, weight="pretrain", save_dir=plan.io.checkpoint_dir)
    reference = MiniMindForCausalLM(config)
    reference.load_state_dict(ckp["model"])
    ref_optimizer = torch.optim.AdamW(reference.parameters())
    ref_optimizer.load_state_dict(ckp["optimizer"])
    for group in ref_optimizer.param_groups:
        group["lr"] = lr
    out = reference(input_ids, labels=input_ids)
    (out.loss + out.aux_loss).backward()
    grads = [p.grad for p in reference.parameters()]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))  # float64: see minimind_step
    for g in grads:
        g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
    ref_optimizer.step()
    assert float(metrics["ce"] + metrics["aux"]) == pytest.approx((out.loss + out.aux_loss).item(), rel=1e-6)
    weights = dict(reference.named_parameters())
    for name, param in trainer.model_parts[0].named_parameters():
        # as in test_minimind_resume: a clip coefficient ~1e-7 apart moves a weight by ~1e-7 * lr, plus fp32 rounding
        tolerance = 1e-6 * lr + 4 * 2 ** -24 * weights[name].abs().max().item()
        assert (param.detach() - weights[name].detach()).abs().max().item() <= tolerance, name
