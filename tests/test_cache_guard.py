"""dataset/cache_guard.py: a damaged token cache is found when opened and built again (with a note), and a cache
build that fills the disk is one line that names the cache, with nothing of it left behind."""
import json
import os

import pytest
import torch

from dataset.cache_guard import cache_problem
from dataset.chat import SFTDataset
from dataset.lm_dataset import PretrainDataset
from tests.helpers.launch import demo_slice


def items(ds):
    return [tuple(t.clone() for t in ds[i]) for i in range(len(ds))]


def cut_in_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("kind,damage,problem", [
    ("pretrain", lambda c: cut_in_half(os.path.join(c, "tokens.bin")), "tokens.bin holds {half} bytes, its header "
                                                                        "says {size}"),
    ("pretrain", lambda c: flip_a_byte(os.path.join(c, "offsets.bin"), 8 * 5), "offsets.bin does not match its "
                                                                              "checksum"),
    ("sft", lambda c: os.remove(os.path.join(c, "mask.bin")), "mask.bin is missing"),
    ("sft", lambda c: open(os.path.join(c, "meta.json"), "w").write("{\"num_docs\""), "meta.json is unreadable "
                                                                                     "(JSONDecodeError)"),
])
def test_a_damaged_cache_is_built_again_with_a_note(tmp_path, tokenizer, capsys, kind, damage, problem):
    data = demo_slice(tmp_path, kind, 40)
    make = PretrainDataset if kind == "pretrain" else SFTDataset
    expected = items(make(data, tokenizer, max_length=32, cache_dir=tmp_path / "fresh"))  # built once, untouched
    ds = make(data, tokenizer, max_length=32, cache_dir=tmp_path / "c")
    size = os.path.getsize(os.path.join(ds.cache_path, "tokens.bin"))
    damage(ds.cache_path)
    problem = problem.format(half=size // 2, size=size)
    assert cache_problem(ds.cache_path) == problem
    capsys.readouterr()
    reopened = make(data, tokenizer, max_length=32, cache_dir=tmp_path / "c")
    assert capsys.readouterr().out.strip() == (f"note: the token cache {ds.cache_path} is damaged ({problem}); "
                                               "building it again")
    got = items(reopened)
    assert len(got) == len(expected) and all(all(torch.equal(a, b) for a, b in zip(x, y))
                                             for x, y in zip(got, expected))
    assert cache_problem(reopened.cache_path) is None
    assert sorted(os.listdir(tmp_path / "c")) == [os.path.basename(ds.cache_path)]  # the damaged one is gone


def test_a_cache_of_the_earlier_format_without_sizes_is_checked_by_its_counts(tmp_path, tokenizer):
    """A cache written before meta.json held sizes and a checksum: num_docs and num_tokens still fix every size."""
    ds = PretrainDataset(demo_slice(tmp_path, "pretrain", 20), tokenizer, max_length=32, cache_dir=tmp_path / "c")
    meta_path = os.path.join(ds.cache_path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({k: v for k, v in meta.items() if k not in ("files", "offsets_sha256")}, f)
    assert cache_problem(ds.cache_path) is None
    cut_in_half(os.path.join(ds.cache_path, "offsets.bin"))
    assert cache_problem(ds.cache_path).startswith("offsets.bin holds ")


def test_a_full_disk_while_building_is_one_line_and_leaves_nothing(tmp_path, tokenizer, small_disk):  # noqa: F811
    """A corpus whose tokens do not fit a 1 MB disk: ValueError (load_datasets makes it the run's one error line)."""
    data = tmp_path / "big.jsonl"
    with open(demo_slice(tmp_path, "pretrain", 2000)) as src:
        text = src.read()
    data.write_text(text * 3)
    disk = small_disk(1)
    with pytest.raises(ValueError) as caught:
        PretrainDataset(str(data), tokenizer, max_length=32, cache_dir=disk, num_proc=1)
    message = str(caught.value)
    assert message.startswith(f"disk full while building the token cache {disk}/big.jsonl.pretrain.") and \
        message.endswith(" (No space left on device); free space or choose another --cache_dir, then run again")
    # no temporary file, no part, no lock: only the note for other ranks that the build failed (cleared by the next)
    left = [name for _, dirs, names in os.walk(disk) for name in dirs + names]
    assert len(left) <= 1 and all(name.endswith(".error") for name in left), left
