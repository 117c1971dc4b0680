"""A damaged newest checkpoint costs its step only (trainer/ckpt/step_dirs.py damage, agreed_checkpoint): the sizes
and crc32 recorded in complete.json at save, .metadata's byte ranges and train_state.pt are checked before any model is
built; --from_resume 1 falls back to the newest step that loads, with a note, and continues exactly."""
import json
import os
import shutil
import zlib

import pytest

from model.errors import ConfigError
from model.weights.shapes import WeightsError
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics, spawn
from trainer.ckpt.resume import read_checkpoint_model
from trainer.ckpt.step_dirs import MANIFEST, TRAIN_STATE, agreed_checkpoint, content_share, damage

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


def flip(path):
    """Invert the bits of the byte in the middle of `path` (its size stays)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def crc(path):
    """crc32 of the whole file read at once: the reference for the streamed sums."""
    return f"{zlib.crc32(path.read_bytes()):08x}"


def test_the_manifest_records_every_file_its_size_and_crc32(saved_run):
    """complete.json holds each file's size and crc32 (every file but itself); the shards' sums were taken as DCP wrote
    them (crc32_0.json, the rank's own record) and equal the files' as read back."""
    _, run_dir, _ = saved_run
    step = run_dir / "step_6"
    manifest = json.loads((step / MANIFEST).read_text())
    files = [p for p in step.iterdir() if p.name != MANIFEST]
    assert manifest["files"] == {p.name: p.stat().st_size for p in files}
    assert manifest["crc32"] == {p.name: crc(p) for p in files}
    assert {TRAIN_STATE, ".metadata", shard(step).name, "rng_0.pt", "crc32_0.json"} <= set(manifest["files"])
    assert json.loads((step / "crc32_0.json").read_text()) == {p.name: crc(p) for p in files if p.suffix == ".distcp"}


def test_the_ranks_share_the_read_largest_first():
    """Each file goes to the rank with the fewest bytes so far, largest first (by hand: a to rank 0; b to rank 1; c to
    rank 1, 60 < 100; d to rank 0, 100 < 110); every file is read by one rank."""
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    assert [content_share(sizes, r, 2) for r in (0, 1)] == [["a", "d"], ["b", "c"]]
    assert content_share(sizes, 0, 1) == ["a", "b", "c", "d"]
    assert sorted(n for r in range(3) for n in content_share(sizes, r, 3)) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("victim", ["shard", ".metadata", TRAIN_STATE, "old manifest", "shard byte", "rng byte"])
def test_each_damaged_file_is_named_and_the_step_before_is_used(saved_run, tmp_path, victim):
    """A cut shard, .metadata or train_state.pt (and a cut shard under a manifest written before sizes were: .metadata's
    byte ranges find it), or one byte flipped in a shard or an RNG file (sizes whole: the crc32 finds it), skip step 6
    with a note naming the file; step 4 is the one resumed."""
    _, run_dir, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step = copy / "step_6"
    path = step / "rng_0.pt" if victim == "rng byte" else shard(step) if "shard" in victim or "old" in victim else \
        step / victim
    size, written = path.stat().st_size, crc(path)
    if victim.endswith("byte"):
        flip(path)
    else:
        cut(path, size // 2)
    if victim == "old manifest":
        (step / MANIFEST).write_text(json.dumps({"step": 6, "format_version": 3}))
    why = damage(str(step))
    if victim.endswith("byte"):
        assert why == f"{path.name} holds other bytes than were written (crc32 {crc(path)}, {written} recorded)"
    elif victim == "shard":
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


def test_a_manifest_without_crc32_loads_as_before(saved_run, tmp_path):
    """A step saved before crc32 was recorded (sizes only) loads without a word: its contents are not checked."""
    _, run_dir, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    manifest = json.loads((copy / "step_6" / MANIFEST).read_text())
    del manifest["crc32"]
    (copy / "step_6" / MANIFEST).write_text(json.dumps(manifest))
    flip(copy / "step_6" / "rng_0.pt")
    assert damage(str(copy / "step_6")) is None
    assert agreed_checkpoint(str(copy)) == str(copy / "step_6")


def agree_on_copies(rank, world_size, copies, out_dir):
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump([agreed_checkpoint(copy) for copy in copies], f)


def test_two_ranks_read_a_step_once_between_them_and_agree(saved_run, tmp_path):
    """Two ranks (gloo) each read their share of step 6's contents: a byte flipped in rank 0's share (the shard) or in
    rank 1's alone (its largest file that nothing parses) makes both ranks skip step 6 and resume step 4."""
    _, run_dir, _ = saved_run
    sizes = json.loads((run_dir / "step_6" / MANIFEST).read_text())["files"]
    shares = [content_share(sizes, r, 2) for r in (0, 1)]
    rank1_file = max((n for n in shares[1] if n not in (".metadata", TRAIN_STATE)), key=sizes.get)
    copies = []
    for name in (shard(run_dir / "step_6").name, rank1_file):
        copy = tmp_path / f"flipped_{name}"
        shutil.copytree(run_dir, copy)
        flip(copy / "step_6" / name)
        copies.append(str(copy))
    assert shard(run_dir / "step_6").name in shares[0] and rank1_file not in shares[0]
    spawn(agree_on_copies, 2, copies, str(tmp_path), timeout=120, start_method="fork")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert got == [os.path.join(copy, "step_4") for copy in copies], (rank, got)


@pytest.mark.parametrize("damaged", ["cut", "flipped"])
def test_a_damaged_shard_resumes_exactly_from_the_step_before(saved_run, damaged):
    """Step 6's shard cut to half, or one byte of it flipped (the weights of a resume that would go on silently):
    --from_resume 1 names it in a note, resumes step 4 and trains steps 5 and 6 to the uninterrupted run's losses (one
    process, the same reduction order: equal to fp32 rounding)."""
    args, run_dir, want = saved_run
    path = shard(run_dir / "step_6")
    size, written = path.stat().st_size, crc(path)
    if damaged == "cut":
        cut(path, size // 2)
        why = f"{path} holds {size // 2} bytes, {size} were written"
    else:
        flip(path)
        why = f"{path} holds other bytes than were written (crc32 {crc(path)}, {written} recorded)"
    run = forked(SCRIPT, [*args, "--from_resume", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"note: skipped step 6 ({why}): resuming from step 4, the newest complete step that loads" in run.stdout
    assert f"Resuming from {run_dir / 'step_4'}" in run.stdout
    got = read_metrics(str(run_dir.parent.parent / "out" / "m.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got[4:], want[4:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], (a, b)
    assert damage(str(run_dir / "step_6")) is None  # written again, whole
