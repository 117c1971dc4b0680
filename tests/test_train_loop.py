"""trainer/train_loop.py in one process: the effective log interval, steps per epoch, the host reads of a step."""
import argparse
import os
import re
import traceback
from types import SimpleNamespace

import pytest
import torch

from tests.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.flags import add_train_args
from trainer.progress import Bar, effective_log_interval
from trainer.train_loop import build_trainer, setup, steps_per_epoch, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("log_interval,steps,expected", [
    (None, 6, 1),  # the full-size default run: 6 steps an epoch, so every step is logged, not only the last
    (None, 250, 25),  # a tenth of the epoch
    (None, 5000, 100),  # MiniMind's 100
    (10, 96, 10),  # a typed interval as typed (it was min(10, 96 // 10) = 9: the small run logged every 9 steps)
    (100, 6, 100),
    (1, 3, 1),
])
def test_a_record_at_least_every_tenth_of_an_epoch_unless_typed(log_interval, steps, expected):
    assert effective_log_interval(SimpleNamespace(log_interval=log_interval), steps) == expected


def test_steps_per_epoch_drops_the_partial_global_batch():
    assert steps_per_epoch(SimpleNamespace(global_batch=8), list(range(60))) == 7


def count_host_reads(monkeypatch, fn):
    """fn()'s tensor->host reads (item, tolist, bool, int, float, nonzero) as (file under the repo, caller, name)."""
    calls = []

    def site():
        for frame in traceback.extract_stack()[-3::-1]:  # the innermost caller in model/, trainer/ or torch
            if "/torch/" in frame.filename or frame.filename.startswith(ROOT):
                return os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else "torch", frame.name
        return "?", "?"

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append((*site(), _name, self.device.type))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    fn()
    monkeypatch.undo()
    return calls


@pytest.mark.parametrize("use_moe", [0, 1])
def test_a_step_reads_the_device_once(monkeypatch, tmp_path, use_moe):
    """A non-log optimizer step (2 micro-batches, packed rows with documents): the guard's one tolist is the only read
    of a computed value in trainer/ and model/ besides MoE's one split-size read per layer and micro-batch; the
    target counts read the CPU labels (never a device tensor); the per-micro-batch bar reads the loss on CPU only."""
    args = add_train_args(argparse.ArgumentParser()).parse_args([
        "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--batch_size", "2", "--accumulation_steps", "2", "--max_seq_len", "16",
        "--loss_chunk_size", "0", "--use_moe", str(use_moe), "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")])
    plan, dims = setup(args)
    trainer = build_trainer(plan, dims, steps_per_epoch=10)
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, -1)  # two documents a row
    batches = [(ids, ids.clone(), positions) for ids in (torch.randint(3, 500, (2, 16), generator=g) for _ in range(2))]
    bar = Bar(trainer)
    train_step(trainer, batches, bar)  # the first step (lazy state, allocator) is not the one counted
    reads = count_host_reads(monkeypatch, lambda: train_step(trainer, batches, bar))
    bar.close()
    ours = [r for r in reads if r[0].startswith(("trainer/", "model/"))]
    expected = [("trainer/guard.py", "check", "tolist", "cpu")]
    expected += [("trainer/objective.py", "target_tokens", "__int__", "cpu")] * 2  # the CPU labels' target counts
    expected += [("trainer/progress.py", "running_loss", "__float__", "cpu")] * 2  # the bar, on CPU only
    if use_moe:
        expected += [("model/model_minimind.py", "dispatch", "tolist", "cpu")] * 2 * 2  # per layer, per micro-batch
    assert sorted(ours) == sorted(expected), ours


def test_the_bar_shows_the_log_lines_loss_under_data_parallel(tmp_path):
    """2 ranks: the bar's loss at a step's end is the step loss summed over the ranks (the guard's all-reduce), the
    log line's, not rank 0's share (which was about half of it)."""
    data = demo_slice(tmp_path, "pretrain", 100)
    out = str(tmp_path / "out")
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "32", "--batch_size", "2",
        "--accumulation_steps", "2", "--max_steps", "3", "--log_interval", "1", "--save_dir", out, "--checkpoint_dir",
        os.path.join(out, "ckpt"), "--metrics_file", os.path.join(out, "m.jsonl")], 2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = re.findall(r"\| 6/6 .*?loss=([0-9.]+), lr=", proc.stderr)  # the final bar (3 steps x 2 micro-batches)
    records = read_metrics(os.path.join(out, "m.jsonl"))
    assert final == [f"{records[-1]['loss']:.4f}"], (final, records[-1]["loss"], proc.stderr[-2000:])
