"""trainer/checkpoint.py: atomic resume files, their load-time checks, TrainState and format versions."""
import os
import subprocess
import sys

import pytest
import torch

from model.model_minimind import MiniMindConfig
from trainer.checkpoint import FORMAT_VERSION, TrainState, lm_checkpoint, resume_path
from trainer.trainer_utils import ConfigError


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
from trainer import checkpoint
from model.model_minimind import MiniMindConfig
real_save = torch.save
def save_then_die(obj, f, *a, **k):
    real_save(obj, f, *a, **k)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before fsync/rename
torch.save = save_then_die
config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
checkpoint.lm_checkpoint(config, weight="t", state={"model": {"w": torch.ones(1000, 1000)}, "epoch": 2}, save_dir=sys.argv[2])
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tiny_config()
    lm_checkpoint(config, weight="t", state={"model": {"w": torch.zeros(2)}, "epoch": 1}, save_dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, root, str(tmp_path)], timeout=120)
    assert proc.returncode == -9  # really killed midway
    loaded = lm_checkpoint(config, weight="t", save_dir=str(tmp_path))
    assert loaded["epoch"] == 1 and torch.equal(loaded["model"]["w"], torch.zeros(2))  # the old one, intact


def test_train_state_round_trip():
    state = TrainState(epoch=1, step_in_epoch=2, global_step=7, tokens_seen=1234, tracker_id="run-x")
    saved = state.state_dict()
    assert saved == dict(epoch=1, step_in_epoch=2, global_step=7, tokens_seen=1234, tracker_id="run-x")
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert fresh == state


def write_format1(path, config, **counters):
    """A resume file as the trainer wrote it before format 2: flat counters beside model and args."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(model={"w": torch.ones(2)}, optimizer={}, scaler={}, rng={}, world_size=2, global_batch=8,
                    args={"hidden_size": 64}, config=config.to_dict(), format_version=1, **counters), path)


def test_format1_checkpoint_loads_as_a_train_state(tmp_path):
    config = tiny_config()
    path = resume_path(config, "t", str(tmp_path))
    write_format1(path, config, epoch=1, step_in_epoch=3, global_step=9, tokens_seen=4321, tracker_id=None)
    ckpt = lm_checkpoint(config, weight="t", save_dir=str(tmp_path))
    assert ckpt["format_version"] == FORMAT_VERSION == 2
    assert ckpt["train_state"] == dict(epoch=1, step_in_epoch=3, global_step=9, tokens_seen=4321, tracker_id=None)
    assert torch.equal(ckpt["model"]["w"], torch.ones(2)) and ckpt["args"] == {"hidden_size": 64}


def test_checkpoint_without_tokens_seen_is_refused_naming_its_format(tmp_path):
    """Commit 7ec8d16 wrote format 1 without tokens_seen; resuming it once raised KeyError."""
    config = tiny_config()
    write_format1(resume_path(config, "t", str(tmp_path)), config, epoch=0, step_in_epoch=3, global_step=3,
                  tracker_id=None)
    with pytest.raises(ConfigError, match="has checkpoint format 1 without tokens_seen"):
        lm_checkpoint(config, weight="t", save_dir=str(tmp_path))


def test_newer_format_is_refused(tmp_path):
    config = tiny_config()
    torch.save(dict(config=config.to_dict(), format_version=FORMAT_VERSION + 1), resume_path(config, "t", str(tmp_path)))
    with pytest.raises(ConfigError, match=f"has checkpoint format {FORMAT_VERSION + 1}, newer than"):
        lm_checkpoint(config, weight="t", save_dir=str(tmp_path))
