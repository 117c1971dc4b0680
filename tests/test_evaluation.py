"""trainer/core/evaluation.py: validation under a pipeline (the schedule's forward-only pass) gives the single process's
eval loss and bits per byte, with --eval_batches not a multiple of the micro-batches a pass takes."""
import json
import os

import pytest

from tests.helpers.launch import TINY_MODEL, demo_slice, forked

EVAL_BATCHES = 3  # two passes of 2 micro-batches under pp: the second filled up with a row without targets


def eval_records(workdir):
    with open(os.path.join(workdir, "m.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval_loss" in r]


@pytest.mark.parametrize("nproc,layout", [(2, ["--pp", "2"]), (4, ["--pp", "2", "--tp", "2"])])
def test_pipeline_eval_equals_the_single_process(tmp_path, nproc, layout):
    lines = open(demo_slice(tmp_path, "pretrain", 120, name="all.jsonl")).readlines()
    (tmp_path / "train.jsonl").write_text("".join(lines[:64]))
    (tmp_path / "eval.jsonl").write_text("".join(lines[64:]))
    common = [*TINY_MODEL, "--data_path", str(tmp_path / "train.jsonl"), "--eval_data_path",
              str(tmp_path / "eval.jsonl"), "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
              "--max_steps", "3", "--eval_interval", "2", "--eval_batches", str(EVAL_BATCHES), "--log_interval", "1",
              "--packing", "1"]
    runs = {}
    for name, n, extra in (("single", 1, []), ("pipeline", nproc, layout)):
        workdir = str(tmp_path / name)
        proc = forked("trainer/train_pretrain.py", [*common, *extra, "--save_dir", workdir, "--checkpoint_dir",
                                                    os.path.join(workdir, "ckpt"), "--metrics_file",
                                                    os.path.join(workdir, "m.jsonl")], nproc=n, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[name] = eval_records(workdir)
    assert [r["step"] for r in runs["single"]] == [2, 3]  # every 2 steps, and at the end
    assert len(runs["pipeline"]) == len(runs["single"]), runs  # zip would stop at the shorter one
    for got, want in zip(runs["pipeline"], runs["single"]):
        assert got["step"] == want["step"]
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5), (got, want)
        assert got["eval_bpb"] == pytest.approx(want["eval_bpb"], rel=1e-5), (got, want)  # bytes counted once
