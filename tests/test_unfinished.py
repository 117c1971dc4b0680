"""Weights of a run that did not finish are named as such: the sidecar records the step, the planned total and whether
the run finished; a stage started from them says so in one line and in its start line and records it in its own
sidecar; an export of them says so; an export does not replace another unless --overwrite 1."""
import json
import os
import signal

from scripts.convert_model import main as convert_main
from tests.helpers.launch import TINY_MODEL, demo_slice, forked
from tests.helpers.preempt_runs import signal_at_micro_batch


def sidecar(path):
    with open(os.path.splitext(path)[0] + ".json") as f:
        return json.load(f)


def test_a_stopped_run_is_named_by_the_next_stage_and_the_export(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    common = [*TINY_MODEL, "--max_seq_len", "64", "--batch_size", "2", "--accumulation_steps", "1", "--save_dir", out,
              "--checkpoint_dir", str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")]
    signal_at_micro_batch(monkeypatch, 3, signal.SIGTERM)  # inside step 3: dropped, step 2 saved
    stopped = forked("trainer/train_pretrain.py", [*common, "--data_path", demo_slice(tmp_path, "pretrain", 200),
                                                   "--max_steps", "6"])
    monkeypatch.undo()
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    base = os.path.join(out, "pretrain_64.pth")
    assert {k: sidecar(base)[k] for k in ("step", "total_steps", "finished")} == dict(step=2, total_steps=6,
                                                                                     finished=False)
    sft = forked("trainer/train_sft.py", [*common, "--data_path", demo_slice(tmp_path, "sft", 40), "--from_weight",
                                          base, "--max_steps", "1"])
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "\n1 optimizer step (--max_steps 1;" in sft.stdout and "\nDone: 1 step, weights in" in sft.stdout
    note = (f"note: {base} holds step 2 of 6 of a run stopped before its end; to finish it first, rerun that run's "
            "command with --from_resume 1")
    assert sft.stdout.count(note) == 1, sft.stdout[-3000:]
    assert f"weights {base} (sha256 " in sft.stdout and "), unfinished: step 2 of 6\n" in sft.stdout
    record = sidecar(os.path.join(out, "full_sft_64.pth"))
    assert record["from_weight"] == dict(path=base, step=2, total_steps=6, finished=False)
    assert (record["step"], record["total_steps"], record["finished"]) == (1, 1, True)  # --max_steps 1 reached
    capsys.readouterr()
    assert convert_main(["--weight", base, "--out_dir", str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr()
    assert note in printed.out.splitlines()
    assert "Writing model shards" not in printed.err  # transformers' bar on every save: silenced
    # a finished run's weights: no note, on start or export
    assert convert_main(["--weight", os.path.join(out, "full_sft_64.pth"), "--out_dir", str(tmp_path / "hf2")]) == 0
    assert "note: " not in capsys.readouterr().out
