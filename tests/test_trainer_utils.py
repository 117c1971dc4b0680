"""get_lr, SkipBatchSampler, atomic checkpoints and their load-time checks."""
import math
import os
import subprocess
import sys

import pytest
import torch

from model.model_minimind import MiniMindConfig
from trainer.trainer_utils import ConfigError, SkipBatchSampler, get_lr, lm_checkpoint, resume_path


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


def tiny_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return MiniMindConfig(**dict(base, **kw))


def test_checkpoint_round_trip_and_mismatch(tmp_path):
    config = tiny_config()
    state = {"model": {"w": torch.arange(3.0)}, "epoch": 1}
    path = lm_checkpoint(config, weight="t", state=state, save_dir=str(tmp_path))
    assert path == resume_path(config, "t", str(tmp_path)) and path.endswith("t_64_resume.pth")
    loaded = lm_checkpoint(config, weight="t", save_dir=str(tmp_path))
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0)) and loaded["epoch"] == 1
    other = tiny_config(num_hidden_layers=3)
    os.rename(path, resume_path(other, "t", str(tmp_path)))
    with pytest.raises(ConfigError, match=r"t_64_resume.pth was saved with num_hidden_layers=2 but this run has num_hidden_layers=3"):
        lm_checkpoint(other, weight="t", save_dir=str(tmp_path))


def test_corrupt_checkpoint_is_one_clear_error(tmp_path):
    config = tiny_config()
    path = resume_path(config, "t", str(tmp_path))
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 truncated garbage")
    with pytest.raises(ConfigError, match="is not a readable checkpoint"):
        lm_checkpoint(config, weight="t", save_dir=str(tmp_path))


KILL_MIDWAY = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
from trainer import trainer_utils
from model.model_minimind import MiniMindConfig
real_save = torch.save
def save_then_die(obj, f, *a, **k):
    real_save(obj, f, *a, **k)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before fsync/rename
torch.save = save_then_die
config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
trainer_utils.lm_checkpoint(config, weight="t", state={"model": {"w": torch.ones(1000, 1000)}, "epoch": 2}, save_dir=sys.argv[2])
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tiny_config()
    lm_checkpoint(config, weight="t", state={"model": {"w": torch.zeros(2)}, "epoch": 1}, save_dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, root, str(tmp_path)], timeout=120)
    assert proc.returncode == -9  # really killed midway
    loaded = lm_checkpoint(config, weight="t", save_dir=str(tmp_path))
    assert loaded["epoch"] == 1 and torch.equal(loaded["model"]["w"], torch.zeros(2))  # the old one, intact
