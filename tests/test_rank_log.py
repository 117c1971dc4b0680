"""trainer/base/rank_log.py: every rank writes its own timestamped log; the lines rank 0 alone prints are there on
every rank, each logged step carries this rank's own values, and a resumed run appends to the same file."""
import json
import os
import re

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} ")


def test_each_rank_logs_its_own_view_and_a_resume_appends(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 48)
    out = tmp_path / "out"
    args = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "1",
            "--log_interval", "1", "--save_dir", str(out), "--checkpoint_dir", str(tmp_path / "ckpt")]
    for extra in (["--max_steps", "2"], ["--max_steps", "3", "--from_resume", "1"]):
        proc = forked("trainer/train_pretrain.py", args + extra, nproc=2, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Model params") == 1  # printed by rank 0 only
    records = {r["step"]: r for r in read_metrics(str(out / "pretrain_64_metrics.jsonl"))}
    for rank in (0, 1):
        lines = (out / "logs" / f"pretrain_64_rank_{rank}.log").read_text().splitlines()
        assert lines and all(STAMP.match(line) for line in lines)
        text = [line[24:] for line in lines]
        starts = [t for t in text if t.startswith("start: ")]
        assert len(starts) == 2 and all(t.startswith(f"start: pretrain_64, rank {rank} of 2 (host") for t in starts)
        assert any(t.startswith("Model params") for t in text)  # rank 0's console line, in every rank's log
        steps = {int(t.split(":")[0][5:]): json.loads(t.split(": ", 1)[1]) for t in text if t.startswith("step ")}
        assert sorted(steps) == [1, 2, 3]
        for step, logged in steps.items():
            assert logged["loss"] == records[step]["loss"]
            assert logged["this_rank"]["peak_mem_gb"] == records[step]["peak_mem_gb_per_rank"][rank]
        assert "saved the checkpoint of step 2" in text and text[-1].startswith("Done: 3 steps")
    elsewhere = ["--save_dir", str(tmp_path / "o2"), "--checkpoint_dir", str(tmp_path / "ckpt2")]
    proc = forked("trainer/train_pretrain.py", [*args, "--max_steps", "1", *elsewhere, "--log_dir", "none"],
                  timeout=300)
    assert proc.returncode == 0 and not os.path.exists(tmp_path / "o2" / "logs")
