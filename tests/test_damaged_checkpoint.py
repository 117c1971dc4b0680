"""A damaged newest checkpoint costs its step only (trainer/ckpt/step_dirs.py damage, loadable_steps): the sizes
recorded in complete.json at save, .metadata's byte ranges and train_state.pt are checked before any model is built;
--from_resume 1 falls back to the newest step that loads, with a note, and continues exactly."""
import json
import os
import shutil

import pytest

from model.weight_shapes import WeightsError
from tests.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.base.errors import ConfigError
from trainer.ckpt.checkpoint import read_checkpoint_model
from trainer.ckpt.step_dirs import MANIFEST, TRAIN_STATE, agreed_checkpoint, damage

SCRIPT = "trainer/train_pretrain.py"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One uninterrupted single-process run of 6 steps, a checkpoint every 2, all kept: (args, run dir, records)."""
    tmp = tmp_path_factory.mktemp("damaged")
    out = tmp / "out"
    args = [*TINY_MODEL, "--data_path", demo_slice(tmp, "pretrain", 64), "--max_seq_len", "32", "--batch_size", "2",
            "--max_steps", "6", "--save_interval", "2", "--keep_checkpoints", "0", "--log_interval", "1",
            "--save_dir", str(out), "--checkpoint_dir", str(tmp / "ckpt"), "--metrics_file", str(out / "m.jsonl")]
    run = forked(SCRIPT, args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return args, tmp / "ckpt" / "pretrain_64", read_metrics(str(out / "m.jsonl"))


def shard(step_dir):
    """The largest DCP shard file of a step directory (the model and optimizer state)."""
    return max((p for p in step_dir.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def cut(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_the_manifest_records_every_file_and_its_size(saved_run):
    _, run_dir, _ = saved_run
    step = run_dir / "step_6"
    recorded = json.loads((step / MANIFEST).read_text())["files"]
    assert recorded == {p.name: p.stat().st_size for p in step.iterdir() if p.name != MANIFEST}
    assert TRAIN_STATE in recorded and ".metadata" in recorded and shard(step).name in recorded


@pytest.mark.parametrize("victim", ["shard", ".metadata", TRAIN_STATE, "old manifest"])
def test_each_damaged_file_is_named_and_the_step_before_is_used(saved_run, tmp_path, victim):
    """A cut shard, .metadata or train_state.pt (and a cut shard under a manifest written before sizes were: .metadata's
    byte ranges find it) skip step 6 with a note naming the file; step 4 is the one resumed."""
    _, run_dir, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step = copy / "step_6"
    path = shard(step) if victim in ("shard", "old manifest") else step / victim
    size = path.stat().st_size
    cut(path, size // 2)
    if victim == "old manifest":
        (step / MANIFEST).write_text(json.dumps({"step": 6, "format_version": 3}))
    why = damage(str(step))
    if victim == "shard":
        assert why == f"{path.name} holds {size // 2} bytes, {size} were written"
    elif victim == "old manifest":
        assert why.startswith(f"{path.name} holds {size // 2} bytes, .metadata names ")
        assert int(why.split()[-1]) > size // 2
    else:
        assert why == f"{victim} holds {size // 2} bytes, {size} were written"
    assert damage(str(copy / "step_4")) is None
    assert agreed_checkpoint(str(copy)) == str(copy / "step_4")
    with pytest.raises(WeightsError) as refused:  # the step named as weights (eval_llm --checkpoint, convert_model)
        read_checkpoint_model(str(step))
    assert str(refused.value) == f"{step}/{why}: the checkpoint is damaged; pass another step_<N> directory"


def test_every_step_damaged_is_one_line(saved_run, tmp_path):
    _, run_dir, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for step in (2, 4, 6):
        os.remove(copy / f"step_{step}" / TRAIN_STATE)
    with pytest.raises(ConfigError) as refused:
        agreed_checkpoint(str(copy))
    assert str(refused.value) == (
        f"no complete checkpoint in {copy} loads: step 6 ({copy}/step_6/{TRAIN_STATE} is missing); step 4 "
        f"({copy}/step_4/{TRAIN_STATE} is missing); step 2 ({copy}/step_2/{TRAIN_STATE} is missing); delete the "
        "damaged step directories, or pass --from_resume 0 --overwrite 1 to start over")


def test_a_cut_shard_resumes_exactly_from_the_step_before(saved_run):
    """Step 6's shard cut to half: --from_resume 1 names it in a note, resumes step 4 and trains steps 5 and 6 to the
    uninterrupted run's losses (one process, the same reduction order: equal to fp32 rounding)."""
    args, run_dir, want = saved_run
    path = shard(run_dir / "step_6")
    size = path.stat().st_size
    cut(path, size // 2)
    run = forked(SCRIPT, [*args, "--from_resume", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert (f"note: skipped step 6 ({path} holds {size // 2} bytes, {size} were written): resuming from step 4, the "
            "newest complete step that loads") in run.stdout
    assert f"Resuming from {run_dir / 'step_4'}" in run.stdout
    got = read_metrics(str(run_dir.parent.parent / "out" / "m.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got[4:], want[4:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], (a, b)
    assert damage(str(run_dir / "step_6")) is None  # written again, whole
