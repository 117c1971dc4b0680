"""trainer/checkpoint.py: DCP resume directories (round trip, manifest, pruning), the legacy single files and their
load-time checks, TrainState and format versions."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    Checkpointer,
    TrainState,
    latest_checkpoint,
    lm_checkpoint,
    load_resume,
    resume_path,
)
from trainer.launch import ConfigError
from trainer.parallel.state_dict import load_sharded_state, sharded_state_dict


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
    with pytest.raises(ConfigError, match=r"t_64_resume.pth was saved with num_hidden_layers=2 "
                                          r"but this run has num_hidden_layers=3"):
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
state = {"model": {"w": torch.ones(1000, 1000)}, "epoch": 2}
checkpoint.lm_checkpoint(config, weight="t", state=state, save_dir=sys.argv[2])
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
    assert ckpt["format_version"] == 2 and FORMAT_VERSION == 3
    assert ckpt["train_state"] == dict(epoch=1, step_in_epoch=3, global_step=9, tokens_seen=4321, tracker_id=None)
    assert torch.equal(ckpt["model"]["w"], torch.ones(2)) and ckpt["args"] == {"hidden_size": 64}


def test_checkpoint_without_tokens_seen_is_refused_naming_its_format(tmp_path):
    """Commit 7ec8d16 wrote format 1 without tokens_seen; resuming it once raised KeyError."""
    config = tiny_config()
    write_format1(resume_path(config, "t", str(tmp_path)), config, epoch=0, step_in_epoch=3, global_step=3,
                  tracker_id=None)
    with pytest.raises(ConfigError, match="has checkpoint format 1 without tokens_seen"):
        lm_checkpoint(config, weight="t", save_dir=str(tmp_path))


def test_single_file_of_another_format_is_refused_naming_it(tmp_path):
    config = tiny_config()
    torch.save(dict(config=config.to_dict(), format_version=FORMAT_VERSION), resume_path(config, "t", str(tmp_path)))
    with pytest.raises(ConfigError, match=f"has checkpoint format {FORMAT_VERSION}, but a single-file resume "
                                          "checkpoint must be format 1 or 2"):
        lm_checkpoint(config, weight="t", save_dir=str(tmp_path))


def trained(config, seed, steps=2):
    """A model and AdamW after `steps` real steps on random tokens (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 16))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_sharded_state_round_trip_is_exact(tmp_path):
    """dcp.save of sharded_state_dict, load_sharded_state into another model: weights and AdamW state equal."""
    config = tiny_config()
    model, optimizer = trained(config, seed=0)
    dcp.save(sharded_state_dict([model], optimizer), checkpoint_id=str(tmp_path / "step_2"))
    fresh, fresh_optimizer = trained(config, seed=1, steps=1)  # other weights, other state, step count 1
    load_sharded_state([fresh], fresh_optimizer, str(tmp_path / "step_2"))
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), name
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def make_steps(run_dir, steps, complete):
    for step in steps:
        os.makedirs(os.path.join(run_dir, f"step_{step}"))
        if step in complete:
            with open(os.path.join(run_dir, f"step_{step}", MANIFEST), "w") as f:
                json.dump({"step": step}, f)


def test_newest_complete_checkpoint_and_pruning(tmp_path):
    """Only a directory with its manifest counts; after a save at step 8, keep 2 leaves steps 6 and 8: partial saves
    (7), older ones (2, 4) and an abandoned later timeline (12, from an earlier run in the same directory) go."""
    run_dir = str(tmp_path / "pretrain_64")
    make_steps(run_dir, [2, 4, 6, 7, 8, 12], complete=[2, 4, 6, 8, 12])
    assert latest_checkpoint(run_dir) == os.path.join(run_dir, "step_12")
    Checkpointer(run_dir, keep=2).prune(8)
    assert sorted(os.listdir(run_dir)) == ["step_6", "step_8"]
    make_steps(str(tmp_path / "all"), [1, 2, 3, 9], complete=[1, 3, 9])
    Checkpointer(str(tmp_path / "all"), keep=0).prune(3)  # keep everything complete up to the save
    assert sorted(os.listdir(tmp_path / "all")) == ["step_1", "step_3"]
    make_steps(str(tmp_path / "partial"), [5], complete=[])
    assert latest_checkpoint(str(tmp_path / "partial")) is None


def test_from_resume_1_without_a_checkpoint_is_refused_and_auto_starts_fresh(tmp_path):
    config = tiny_config()

    def plan(from_resume):
        return SimpleNamespace(checkpoint_dir=str(tmp_path), run_dir=str(tmp_path / "pretrain_64"), global_batch=8,
                               from_resume=from_resume, flags=dict(save_weight="pretrain"))
    make_steps(str(tmp_path / "pretrain_64"), [3], complete=[])  # a save killed before its manifest
    with pytest.raises(ConfigError, match="--from_resume 1 but .*pretrain_64 holds no complete checkpoint"):
        load_resume(config, plan("1"))
    assert load_resume(config, plan("auto")) is None
    assert load_resume(config, plan("0")) is None
