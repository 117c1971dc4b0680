"""trainer/ckpt/storage.py on a real small filesystem (a tmpfs mounted for the test). Where mount is not allowed the
full-disk tests (here and wherever the small_disk fixture of tests/conftest.py is used) are skipped with the reason,
and fail in CI (the CI environment variable set, as CI services do): there they must run (root, or a container with
CAP_SYS_ADMIN)."""
import errno
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from model.atomic import atomic_folder, atomic_save
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.disks import no_small_disk
from tests.helpers.launch import spawn
from trainer.ckpt.checkpointer import keep_line
from trainer.ckpt.storage import (
    DiskFullError,
    check_room,
    checkpoint_bytes_estimate,
    disk_full_as_one_line,
    free_bytes,
    rank0_write,
    room_line,
    room_warning,
    tree_bytes,
)
from trainer.parallel.state_dict import sharded_state_dict

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs counts space in pages
HINT = "free space or choose another --checkpoint_dir, then resume with --from_resume 1"


def test_a_full_disk_test_that_cannot_mount_fails_in_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the full-disk tests"):
        no_small_disk("mount: only root can do that")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="mount -t tmpfs is not permitted: mount: only root"):
        no_small_disk("mount: only root can do that")


def statvfs_free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def trained_model(hidden_size):
    """A MiniMind model and its AdamW after one step (so both moments exist), as a resume checkpoint holds them."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=hidden_size, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).unsqueeze(0), labels=torch.arange(8).unsqueeze(0)).loss.backward()
    optimizer.step()
    return model, optimizer


def test_free_and_tree_bytes_count_pages_and_file_sizes(small_disk):
    disk = small_disk(2)
    assert free_bytes(disk) == 2 * MiB
    os.makedirs(os.path.join(disk, "run", "step_1"))
    with open(os.path.join(disk, "run", "a.bin"), "wb") as f:
        f.write(b"x" * 100_000)
    with open(os.path.join(disk, "run", "step_1", "b.bin"), "wb") as f:
        f.write(b"y" * 5)
    assert tree_bytes(os.path.join(disk, "run")) == 100_005
    used_pages = -(-100_000 // PAGE) + 1
    assert free_bytes(os.path.join(disk, "run", "not", "made", "yet")) == 2 * MiB - used_pages * PAGE
    assert tree_bytes(os.path.join(disk, "absent")) == 0


def test_estimate_covers_a_real_checkpoint_and_weights_file(tmp_path):
    model, optimizer = trained_model(64)
    embedding = model.model.embed_tokens.weight.numel()
    num_params = sum(p.numel() for p in model.parameters())  # the tied lm_head counted once
    dcp.save(sharded_state_dict([model], optimizer), checkpoint_id=str(tmp_path / "step_1"))
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / "w.pth")
    actual = tree_bytes(tmp_path / "step_1") + os.path.getsize(tmp_path / "w.pth")
    estimate = checkpoint_bytes_estimate(model, 2)
    assert estimate == num_params * (4 + 8 + 2) + embedding * (4 + 2)  # the tied weight is saved twice, moments once
    # what the estimate leaves out is metadata (DCP's index, pickled headers): ~0.3 MB whatever the width
    assert estimate <= actual <= estimate + 512 * 1024


def test_sizes_are_printed_in_mebibytes():
    """Bytes / 2**20 are MiB (the lines said MB). 5,000,000 bytes by hand: 5e6 / 1,048,576 = 4.768 -> 4.8 MiB (in MB
    it would be 5.0); three of them 14.305 -> 14.3 MiB; 2,500,000 bytes 2.384 -> 2.4 MiB."""
    assert keep_line("run", 3, 5_000_000) == ("checkpoints: the last 3 kept in run (--keep_checkpoints), "
                                              "~3 x 4.8 MiB = 14.3 MiB")
    assert keep_line("run", 0, 5_000_000).endswith("(--keep_checkpoints 0), ~4.8 MiB each")
    assert room_line("d", 5_000_000, 2_500_000, None).startswith(
        "disk full: d needs 4.8 MiB for a checkpoint but has 2.4 MiB free; no complete checkpoint yet;")


def test_check_room_refuses_a_checkpoint_larger_than_the_free_space(small_disk):
    disk = small_disk(2)
    check_room(disk, 1 * MiB)  # fits: no error
    with pytest.raises(DiskFullError) as error:
        check_room(disk, 3 * MiB, last_complete=os.path.join(disk, "step_4"))
    assert str(error.value) == (f"disk full: {disk} needs 3.0 MiB for a checkpoint but has 2.0 MiB free; "
                                f"the last complete checkpoint is {disk}/step_4; {HINT}")
    assert room_warning(disk, 1 * MiB) is None
    assert room_warning(disk, 3 * MiB) == (f"warning: {disk} has 2.0 MiB free, less than one checkpoint (~3.0 MiB): "
                                           "saves will fail; free space or choose another --checkpoint_dir")


def test_disk_filling_during_a_dcp_save_is_one_line_and_the_last_checkpoint_survives(small_disk):
    disk = small_disk(4)
    run_dir = os.path.join(disk, "run")
    model, optimizer = trained_model(32)  # ~2.9 MB of fp32 weights + moments: one fits in 4 MB, two do not
    step_1, step_2 = os.path.join(run_dir, "step_1"), os.path.join(run_dir, "step_2")
    saved = {k: v.clone() for k, v in sharded_state_dict([model], optimizer)["model"].items()}
    dcp.save(sharded_state_dict([model], optimizer), checkpoint_id=step_1)
    needed = tree_bytes(step_1)
    free_before = statvfs_free(disk)
    assert free_before < needed
    with pytest.raises(DiskFullError) as error:
        check_room(run_dir, needed, last_complete=step_1)  # what Checkpointer.save checks first
    with pytest.raises(DiskFullError) as error, \
            disk_full_as_one_line(run_dir, needed, last_complete=step_1, partial=step_2):  # a save filling the disk
        dcp.save(sharded_state_dict([model], optimizer), checkpoint_id=step_2)
    # DCP reports the full disk as torch.save's "unexpected pos", not ENOSPC: the line is ours
    assert "unexpected pos" in str(error.value.__cause__)
    free_mb = free_before / MiB
    assert str(error.value) == (f"disk full: {run_dir} needs {needed / MiB:.1f} MiB for a checkpoint but has "
                                f"{free_mb:.1f} MiB free; the last complete checkpoint is {step_1}; {HINT}")
    assert "\n" not in str(error.value)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(loaded, checkpoint_id=step_1)
    for k, v in saved.items():
        assert torch.equal(loaded["model"][k], v), k


def test_other_save_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(ValueError, match="not a disk problem"), disk_full_as_one_line(str(tmp_path), MiB):
        raise ValueError("not a disk problem")
    # ENOSPC named anywhere in the chain is a full disk, whatever the free space
    with pytest.raises(DiskFullError, match=r"^disk full: "), disk_full_as_one_line(str(tmp_path), MiB):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("write failed") from e


def test_a_weights_write_that_fills_the_disk_is_one_line_and_leaves_no_tmp(small_disk):
    """rank0_write around the atomic writer: the file in place stays as it was, the temporary one is gone."""
    disk = small_disk(2)
    path = os.path.join(disk, "out", "pretrain_64.pth")
    atomic_save({"w": torch.zeros(4)}, path)  # an earlier save of the run
    big = {"w": torch.ones(1 << 20)}  # 4 MB: more than the disk holds, though the estimate (1 KB) fits
    with pytest.raises(DiskFullError) as error:
        rank0_write(os.path.dirname(path), 1024, path, "--save_dir", lambda: atomic_save(big, path))
    free = statvfs_free(disk) / MiB
    assert str(error.value) == (f"disk full: {disk}/out needs 0.0 MiB for {path} but has {free:.1f} MiB free; no "
                                "complete checkpoint yet; free space or choose another --save_dir, then run again")
    assert os.listdir(os.path.join(disk, "out")) == ["pretrain_64.pth"]
    assert torch.equal(torch.load(path)["w"], torch.zeros(4))
    with pytest.raises(DiskFullError, match=rf"^disk full: {disk}/out needs 3.0 MiB for {path} but has "):
        rank0_write(os.path.dirname(path), 3 * MiB, path, "--save_dir", lambda: pytest.fail("written"))  # refused


def test_a_folder_write_that_fills_the_disk_leaves_the_previous_folder(small_disk):
    """atomic_folder (the PEFT folder): a block that fills the disk leaves the folder as it was and no other."""
    disk = small_disk(2)
    folder = os.path.join(disk, "lora_peft")
    with atomic_folder(folder) as tmp:
        torch.save({"w": torch.zeros(4)}, os.path.join(tmp, "adapter.pt"))
    with pytest.raises(DiskFullError), disk_full_as_one_line(disk, MiB, what=folder, flag="--save_dir"):
        with atomic_folder(folder) as tmp:
            torch.save({"w": torch.ones(1 << 20)}, os.path.join(tmp, "adapter.pt"))
    assert os.listdir(disk) == ["lora_peft"] and os.listdir(folder) == ["adapter.pt"]
    assert torch.equal(torch.load(os.path.join(folder, "adapter.pt"))["w"], torch.zeros(4))


def _write_on_rank0(rank, world_size, disk):
    """Each rank: rank0_write of a file larger than the disk; write down the line it stopped with."""
    path = os.path.join(disk, "out", "w.pth")
    try:
        rank0_write(os.path.dirname(path), 1024, path, "--save_dir", lambda: atomic_save({"w": torch.ones(1 << 20)},
                                                                                          path))
    except DiskFullError as e:
        with open(os.path.join(disk, f"rank{rank}.line"), "w") as f:
            f.write(str(e))


def test_every_rank_stops_with_rank0_s_line(small_disk):
    """2 gloo ranks: only rank 0 writes; when its write fills the disk, rank 1 stops with the same line (no wait)."""
    disk = small_disk(2)
    spawn(_write_on_rank0, 2, disk, timeout=120, start_method="fork")
    lines = [open(os.path.join(disk, f"rank{r}.line")).read() for r in range(2)]
    assert lines[0] == lines[1] and lines[0].startswith(f"disk full: {disk}/out needs 0.0 MiB for {disk}/out/w.pth")
