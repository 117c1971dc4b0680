"""trainer/runtime/out_of_memory.py: an allocation that fails on one rank ends the run in one `error:` line
from that rank (the step, its peak memory, what to change, the last complete checkpoint), every rank leaves, and that
checkpoint resumes."""
import argparse
import os

import pytest
import torch

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.runtime.out_of_memory import advice, is_out_of_memory


def test_what_counts_as_out_of_memory():
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2 ** 62, dtype=torch.uint8)  # the CPU allocator's own error
    assert is_out_of_memory(refused.value) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_advice_follows_the_layout():
    def plan(*argv, world_size=1):
        args = add_train_args(argparse.ArgumentParser()).parse_args([*TINY_MODEL, "--device", "cpu", *argv])
        return resolve(args, world_size)
    single = advice(plan("--batch_size", "8", "--loss_chunk_size", "0"))
    assert single.startswith("lower --batch_size (now 8;") and "--grad_checkpointing full" in single
    assert "--loss_chunk_size 1024" in single and "--zero_stage" not in single
    ddp = advice(plan("--grad_checkpointing", "1", world_size=2))
    assert "--zero_stage 1" in ddp and "--grad_checkpointing" not in ddp and "--loss_chunk_size" not in ddp
    assert "--zero_stage" not in advice(plan("--zero_stage", "3", world_size=2))


def test_one_rank_out_of_memory_is_one_line_and_the_checkpoint_resumes(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 64)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
            "--max_steps", "4", "--save_interval", "2", "--log_interval", "1", "--save_dir", str(out),
            "--checkpoint_dir", str(ckpt), "--metrics_file", str(out / "m.jsonl")]
    # every rank leaves: a hang would sit out the 600 s collective timeout, far past forked()'s 120 s
    proc = forked("tests/helpers/fault_entry.py", args, nproc=2, timeout=120,
                  env=dict(MINIMIND_TEST_OOM_AT_STEP="3", MINIMIND_TEST_OOM_RANK="1"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    # the other rank, left waiting in a collective, says so in one line, not a traceback
    assert "stopped: rank 0 lost a peer in a collective" in proc.stderr and "Traceback" not in proc.stderr
    line = errors[0]
    assert line.startswith("error: out of CPU memory on rank 1 in step 3 (peak ") and " GiB on this rank;" in line
    assert ("GiB on this rank; DefaultCPUAllocator: can't allocate memory: you tried to allocate 4611686018427387904 "
            "bytes. Error code 12 (Cannot allocate memory)): lower --batch_size (now 2;") in line
    assert line.endswith(f"the last complete checkpoint is {ckpt / 'pretrain_64' / 'step_2'}, continue with "
                         "--from_resume 1")
    assert line in open(out / "logs" / "pretrain_64_rank_1.log").read()  # the rank's own log has it, timestamped
    assert [r["step"] for r in read_metrics(str(out / "m.jsonl"))] == [1, 2]
    assert sorted(os.listdir(ckpt / "pretrain_64")) == ["step_2"]  # nothing half-written beside it
    resumed = forked("trainer/train_pretrain.py", [*args, "--from_resume", "1"], nproc=2, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {ckpt / 'pretrain_64' / 'step_2'}" in resumed.stdout
    # the resumed curve is the uninterrupted run's: same process count, same reduction order, equal to fp32 rounding
    ref = tmp_path / "ref"
    uninterrupted = forked("trainer/train_pretrain.py", [*args, "--save_dir", str(ref), "--checkpoint_dir",
                                                         str(ref / "ckpt"), "--metrics_file", str(ref / "m.jsonl")],
                           nproc=2, timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    got, want = read_metrics(str(out / "m.jsonl")), read_metrics(str(ref / "m.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], (a, b)
