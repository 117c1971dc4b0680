"""trainer/ckpt/minimind_resume.py: MiniMind's own resume file continues here.

The file is written the way MiniMind's lm_checkpoint writes it (trainer/trainer_utils.py of jingyaogong/minimind), from
a model whose modules register their parameters in MiniMind's order (the test-side tree below, written from
MiniMind's model/model_minimind.py), after real AdamW steps there. MiniMind's optimizer state is indexed by that
order, so a resume here must map index -> parameter by it; the step that follows must equal the one MiniMind's own
resume takes on the same batch.
"""
import argparse
import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from tests.helpers.minimind_order import MiniMindOrder, batches, cosine_lr
from trainer.ckpt.minimind_resume import minimind_parameter_order
from trainer.ckpt.resume import read_resume
from trainer.core.build import build_trainer, setup
from trainer.core.loop import train_step
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.plan.stage import Stage

# ----------------------------------------------------------------------------- MiniMind's registration order
# Each __init__ below registers its children in the order of MiniMind's class of the same name; the forward is ours
# (functional_call), so only the order of parameters(), what MiniMind's AdamW indexes by, differs from our model.


def minimind_step(model, optimizer, input_ids, labels, lr, grad_clip=1.0):
    """MiniMind's train_epoch for one step of one micro-batch: lr, loss, backward, clip, step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model.loss(input_ids, labels)
    loss.backward()
    # clip_grad_norm_(model.parameters(), grad_clip), the norm summed in float64: torch's CPU norm accumulates in one
    # fp32 register (pytorch#169237), ~1e-5 relative here, which would move every update by as much
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    for g in grads:
        g.mul_(min(1.0, grad_clip / (norm + 1e-6)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def lm_checkpoint(path, model, optimizer, epoch, step, world_size=1, scaler=None):
    """MiniMind's lm_checkpoint(...) save: fp16 weights, the optimizer's state_dict, position, extras by state_dict."""
    state_dict = {k: v.half().cpu() for k, v in model.state_dict().items()}
    resume_data = {"model": state_dict, "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
                   "world_size": world_size, "wandb_id": "run-7"}
    resume_data["scaler"] = (scaler or torch.amp.GradScaler("cpu", enabled=False)).state_dict()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(resume_data, path)
    return resume_data


def minimind_run(config, path, steps=3, lr=1e-2, weight_decay=0.05, epoch=0, step=5, world_size=1):
    """MiniMind's training from the seeded init: `steps` AdamW steps, then lm_checkpoint; returns what it saved."""
    torch.manual_seed(3)
    model = MiniMindOrder(config)
    model.load_state_dict(MiniMindForCausalLM(config).state_dict())  # our weights, by name
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for ids in batches(config, steps, seed=1):
        minimind_step(model, optimizer, ids, ids, lr)
    return lm_checkpoint(path, model, optimizer, epoch, step, world_size)


def minimind_resumed_step(config, saved, input_ids, labels, lr):
    """What MiniMind's own --from_resume 1 does next: load the weights and the optimizer state, take one step."""
    model = MiniMindOrder(config)
    model.load_state_dict(saved["model"])  # fp16 into the fp32 parameters, as MiniMind loads it
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(saved["optimizer"])
    loss = minimind_step(model, optimizer, input_ids, labels, lr)
    return loss, {name: p.detach() for name, p in model.named_parameters()}


MOE_FLAGS = ["--use_moe", "1", "--num_experts", "2"]


@pytest.mark.parametrize("use_moe", [0, 1], ids=["dense", "moe"])
def test_the_resumed_step_equals_minimind_s_own_next_step(tmp_path, use_moe):
    """MiniMind's file at step 5 (batch 2, one process) resumed by the real trainer: its first step on a batch equals
    MiniMind's own next step on it, from the same fp16 weights and the moments mapped by MiniMind's order."""
    flags = [*TINY_MODEL, "--batch_size", "2", "--accumulation_steps", "1", "--max_seq_len", "16",
             "--learning_rate", "1e-2", "--from_resume", "1", "--save_dir", str(tmp_path / "out"),
             "--checkpoint_dir", str(tmp_path / "ckpt"), *(MOE_FLAGS if use_moe else [])]
    args = add_train_args(argparse.ArgumentParser()).parse_args(flags)
    planned = resolve(args, 1)  # the file's path and config; it exists before the run starts, as a user's would
    saved = minimind_run(planned.model.config, os.path.join(planned.io.checkpoint_dir,
                                                            f"{planned.io.run_name}_resume.pth"))
    plan, dims = setup(args)
    config = plan.model.config
    assert list(saved["optimizer"]["state"]) == list(range(len(minimind_parameter_order(config))))  # every moment
    steps_per_epoch = 20
    trainer = build_trainer(plan, dims, steps_per_epoch)
    assert trainer.progress.global_step == 5  # MiniMind's step 5 x 2 samples = step 5 at a global batch of 2
    (input_ids,) = batches(config, 1, seed=9)
    metrics = train_step(trainer, [(input_ids, input_ids.clone())])
    lr = cosine_lr(1e-2, 5, steps_per_epoch)
    assert metrics["lr"] == pytest.approx(lr, rel=1e-12)
    loss, weights = minimind_resumed_step(config, saved, input_ids, input_ids, lr)
    # the same forward on the same fp32 weights; the clip norm differs in summation (ours accumulates in float64)
    assert float(metrics["ce"] + metrics["aux"]) == pytest.approx(loss, rel=1e-6)
    for name, param in trainer.model_parts[0].named_parameters():
        # one AdamW update moves a weight by ~lr; a clip coefficient ~1e-7 apart moves it by ~1e-7 * lr, plus the
        # weight's own fp32 rounding
        tolerance = 1e-6 * lr + 4 * 2 ** -24 * weights[name].abs().max().item()
        assert (param.detach() - weights[name]).abs().max().item() <= tolerance, name


def resume_plan(tmp_path, micro_batch=4, global_batch=8, from_resume="1"):
    """The TrainPlan's sections load_resume reads."""
    return SimpleNamespace(io=SimpleNamespace(checkpoint_dir=str(tmp_path), run_dir=str(tmp_path / "pretrain_64"),
                                              from_resume=from_resume, resume_path=None),
                           data=SimpleNamespace(micro_batch=micro_batch, global_batch=global_batch),
                           model=SimpleNamespace(dtype=torch.float32), stage=Stage())


def tiny_config(**kw):
    return MiniMindConfig(**dict(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2), **kw))


def test_the_file_is_read_by_minimind_s_order_and_position(tmp_path):
    """MiniMind's step 5 on 2 processes of 4 samples = 40 samples; at this run's global batch 12 that is step 3."""
    config = tiny_config()
    saved = minimind_run(config, str(tmp_path / "pretrain_64_resume.pth"), epoch=1, step=5, world_size=2)
    ckpt = read_resume(config, resume_plan(tmp_path, 4, 12))
    assert ckpt["train_state"] == dict(epoch=1, step_in_epoch=3, global_step=3, tokens_seen=0, tracker_id="run-7")
    assert ckpt["world_size"] == 2 and ckpt["global_batch"] == 12
    names = [name for name, _ in MiniMindOrder(config).named_parameters()]  # the test-side tree's own order
    assert minimind_parameter_order(config) == names
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ckpt["optimizer"]["state"][name][key], saved["optimizer"]["state"][index][key])
    assert ckpt["optimizer"]["param_groups"][0]["params"] == names
    for name, value in saved["model"].items():
        assert torch.equal(ckpt["model"][name], value), name


def test_moments_in_another_order_are_one_line_naming_the_index(tmp_path):
    """A file whose optimizer follows our order (gate, up, down), not MiniMind's: the first moment whose shape does
    not fit the parameter at its index is named, before any step."""
    config = tiny_config()
    saved = minimind_run(config, str(tmp_path / "pretrain_64_resume.pth"))
    ours = [name for name, _ in MiniMindForCausalLM(config).named_parameters()]
    order = minimind_parameter_order(config)
    by_name = {name: saved["optimizer"]["state"][i] for i, name in enumerate(order)}
    saved["optimizer"]["state"] = {i: by_name[name] for i, name in enumerate(ours)}
    torch.save(saved, tmp_path / "pretrain_64_resume.pth")
    index = order.index("model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ConfigError) as error:
        read_resume(config, resume_plan(tmp_path, 4, 4))
    assert str(error.value) == (
        f"{tmp_path}/pretrain_64_resume.pth: optimizer state {index} (exp_avg) has shape [256, 64], but MiniMind's "
        f"parameter {index} is model.layers.0.mlp.down_proj.weight of shape [64, 256]; this file was not written by "
        "MiniMind's model of these flags: pass --from_resume 0")


def test_a_resume_file_of_another_model_is_one_line(tmp_path):
    minimind_run(tiny_config(num_hidden_layers=3), str(tmp_path / "pretrain_64_resume.pth"), steps=1)
    with pytest.raises(ConfigError, match=r"pretrain_64_resume.pth: the weights have 3 layers .* the model 2; "
                                          "pass --num_hidden_layers 3"):
        read_resume(tiny_config(), resume_plan(tmp_path))


def adamw_bound(saved, new, lr, wd, betas, eps):
    """Max over elements of |computed - recorded| / fp32 rounding bound for one AdamW step from the saved weights and
    moments: the gradient is recovered from the new first moment, then the second moment and the weight predicted."""
    b1, b2, u = betas[0], betas[1], 2.0 ** -24
    w, m, v, t = (saved[k].double() for k in ("w", "exp_avg", "exp_avg_sq", "step"))
    w1, m1, v1 = (new[k].double() for k in ("w", "exp_avg", "exp_avg_sq"))
    g = (m1 - b1 * m) / (1 - b1)
    dg = 4 * u * (m1.abs() + b1 * m.abs()) / (1 - b1)  # rounding of the lerp that produced m1
    v_ref = b2 * v + (1 - b2) * g * g
    v_ratio = (v1 - v_ref).abs() / (4 * u * v1.abs() + (1 - b2) * (2 * g.abs() * dg + dg * dg) + 1e-30)
    t = t + 1
    update = lr / (1 - b1 ** t) * m1 / ((v1 / (1 - b2 ** t)).sqrt() + eps)
    w_ref = w * (1 - lr * wd) - update
    w_ratio = (w1 - w_ref).abs() / (4 * u * w.abs() + 8 * u * update.abs() + 1e-30)
    return v_ratio.max().item(), w_ratio.max().item()


def test_minimind_resume_file_continues_in_the_trainer(tmp_path):
    """The real trainer script resumes MiniMind's file: epoch 0, MiniMind's step 5 x 2 processes x batch 2 = 20
    samples = step 3 at global batch 6 (2 x 3 accumulation); its one step starts from the saved fp16 weights and
    moments, each moment the one MiniMind's order put at its index."""
    config = tiny_config()
    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "out"
    saved = minimind_run(config, str(ckpt_dir / "pretrain_64_resume.pth"), epoch=0, step=5, world_size=2)
    data = demo_slice(tmp_path, "pretrain", 48)  # 48 samples / 6 = 8 steps per epoch
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--save_dir", out, "--checkpoint_dir", ckpt_dir, "--metrics_file", out / "metrics.jsonl",
        "--data_path", data, "--packing", "0", "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "3",
        "--max_steps", "4", "--from_resume", "1", "--log_interval", "1"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "that is step 3 of the epoch" in proc.stdout
    (record,) = read_metrics(str(out / "metrics.jsonl"))
    assert record["step"] == 4 and record["epoch"] == 0
    dcp_to_torch_save(str(ckpt_dir / "pretrain_64" / "step_4"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    for index, name in enumerate(name for name, _ in MiniMindOrder(config).named_parameters()):
        state = saved["optimizer"]["state"][index]
        before = dict(state, w=saved["model"][name])
        after = {k: full["optim"][f"state.{name}.{k}"] for k in ("exp_avg", "exp_avg_sq")}
        after["w"] = full["model"][name]
        assert full["optim"][f"state.{name}.step"] == state["step"] + 1
        assert full["optim"][f"param_groups.{name}.weight_decay"] == 0.05  # MiniMind's optimizer, as it loads it
        v_ratio, w_ratio = adamw_bound(before, after, record["lr"], 0.05, (0.9, 0.999), 1e-8)
        assert v_ratio <= 1 and w_ratio <= 1, (name, v_ratio, w_ratio)
