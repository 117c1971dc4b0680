"""trainer/config.py: the resolved TrainPlan (layout rule, paths, batch) and the flags' help."""
import argparse
import dataclasses
import os

import pytest
import torch

from trainer.config import TrainPlan, add_train_args, data_parallel_mode, resolve
from trainer.trainer_utils import ROOT, ConfigError

TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--device", "cpu"]


def flags(*argv):
    return add_train_args(argparse.ArgumentParser()).parse_args([*TINY, *argv])


@pytest.mark.parametrize("world,layout,expected", [
    (1, {}, (1, 0, "none")),
    (2, {}, (2, 0, "ddp")),
    (2, dict(tp=2), (1, 0, "none")),  # no data-parallel group: the typed stage stays
    (8, dict(tp=2, pp=2), (2, 2, "fsdp2")),  # tp/pp with dp > 1: FSDP2
    (4, dict(tp=2, cp=2), (1, 2, "fsdp2")),  # dp*cp > 1 counts, not dp alone
    (4, dict(pp=2, cp=2), (1, 2, "fsdp2")),
    (4, dict(cp=2, zero_stage=1), (2, 1, "zero1")),
    (2, dict(zero_stage=3), (2, 3, "fsdp2")),
])
def test_data_parallel_mode(world, layout, expected):
    assert data_parallel_mode(world, **layout) == expected


def test_data_parallel_mode_rejects_with_one_line():
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp\\*cp"):
        data_parallel_mode(6, tp=4)
    with pytest.raises(ConfigError, match="cannot be combined with --tp 2"):  # a DDP hook keeps DDP: refused
        data_parallel_mode(4, tp=2, grad_compression="bf16")


def test_resolve_is_frozen_and_leaves_args_as_typed():
    args = flags("--tp", "2", "--pp", "2", "--batch_size", "3", "--accumulation_steps", "4", "--max_seq_len", "64")
    typed = dict(vars(args))
    plan = resolve(args, 8)
    assert vars(args) == typed  # nothing written back
    assert (plan.dp, plan.tp, plan.pp, plan.cp, plan.zero_stage, plan.dp_mode) == (2, 2, 2, 1, 2, "fsdp2")
    assert plan.global_batch == 3 * 4 * 2 and plan.micro_batch_shape == (3, 64)
    assert plan.dtype == torch.float32 and plan.autocast_dtype is None and plan.has_dtensor
    assert not plan.chunked_loss  # tp: vocab-sharded logits
    assert resolve(flags(), 1).chunked_loss and resolve(flags("--cp", "2"), 2).micro_batch_shape == (32, 170)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp = 4
    assert isinstance(plan, TrainPlan)


def test_paths_typed_against_cwd_defaults_against_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    plan = resolve(flags("--save_dir", "mine", "--data_path", "d.jsonl"), 1)
    assert plan.save_dir == str(tmp_path / "mine") and plan.data_path == str(tmp_path / "d.jsonl")
    assert plan.metrics_file == str(tmp_path / "mine" / "pretrain_64_metrics.jsonl")  # keyed by the weight name
    assert plan.checkpoint_dir == os.path.join(ROOT, "checkpoints")
    assert plan.tokenizer_path == os.path.join(ROOT, "model")
    assert plan.cache_dir == os.path.join(ROOT, "dataset", ".cache")
    moe = resolve(flags("--save_dir", "mine", "--use_moe", "1", "--save_weight", "w"), 1)
    assert moe.metrics_file == str(tmp_path / "mine" / "w_64_moe_metrics.jsonl")
    assert resolve(flags(), 1).save_dir == os.path.join(ROOT, "out")


def test_profile_steps_and_model_sizes():
    assert resolve(flags("--profile_steps", "3:5"), 1).profile_steps == (3, 5)
    with pytest.raises(ConfigError, match="--profile_steps"):
        resolve(flags("--profile_steps", "5:3"), 1)
    with pytest.raises(ConfigError, match="A:B"):
        resolve(flags("--profile_steps", "x"), 1)


def test_every_flag_has_help():
    parser = add_train_args(argparse.ArgumentParser())
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert missing == []
