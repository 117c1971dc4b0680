"""dataset/mixture.py: data specs resolve to the files a user means; mixtures hold hand-computed row counts,
depend on (seed, epoch) only, and report what they realised."""
import json
import os
from collections import Counter

import pandas as pd
import pytest
from torch.utils.data import ConcatDataset, Dataset

from dataset.chat import SFTDataset
from dataset.lm_dataset import PretrainDataset
from dataset.mixture import absolute_data_spec, describe_mixture, load_data_spec, resolve_data_spec
from dataset.weighted_mixture import MixtureDataset, _largest_remainder
from tests.helpers.launch import demo_slice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Rows(Dataset):
    """Row i of source s is (s, i): shows where each mixture row came from."""

    def __init__(self, source, n):
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.source, i



def write_texts(path, texts):
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def test_resolve_files_directories_globs_and_weights(tmp_path, monkeypatch):
    write_texts(tmp_path / "a.jsonl", ["x"])
    os.makedirs(tmp_path / "shards")
    for name in ("y.parquet", "x.parquet"):
        pd.DataFrame({"text": ["t"]}).to_parquet(tmp_path / "shards" / name)
    (tmp_path / "shards" / "README.txt").write_text("not data")
    monkeypatch.chdir(tmp_path)  # typed paths resolve against the current directory
    a, shards = [str(tmp_path / "a.jsonl")], [str(tmp_path / "shards" / n) for n in ("x.parquet", "y.parquet")]
    assert resolve_data_spec("a.jsonl:0.7,shards/*.parquet:0.3") == [(a, 0.7), (shards, 0.3)]
    assert resolve_data_spec("a.jsonl:3, shards:1") == [(a, 0.75), (shards, 0.25)]
    assert resolve_data_spec("a.jsonl,shards") == [(a, None), (shards, None)]
    assert resolve_data_spec(str(tmp_path / "a.jsonl")) == [(a, None)]
    with pytest.raises(ValueError, match="to every source or to none"):
        resolve_data_spec("a.jsonl:0.5,shards")
    with pytest.raises(ValueError, match="positive number"):
        resolve_data_spec("a.jsonl:0,shards:1")
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_data_spec("nope/*.jsonl")


def test_largest_remainder_by_hand():
    assert _largest_remainder(40, [0.7, 0.3]) == [28, 12]
    assert _largest_remainder(10, [1 / 3, 1 / 3, 1 / 3]) == [4, 3, 3]  # 3.33 each: the first gets the spare row
    assert _largest_remainder(7, [0.5, 0.25, 0.25]) == [3, 2, 2]  # 3.5, 1.75, 1.75: the two .75 remainders win


def test_mixture_counts_upsampling_and_determinism():
    sources = [Rows(0, 10), Rows(1, 30)]
    mix = MixtureDataset(sources, [0.7, 0.3], seed=5)
    assert len(mix) == 40  # all rows of all sources
    rows = [mix[i] for i in range(len(mix))]
    per_source = Counter(s for s, _ in rows)
    assert per_source == {0: 28, 1: 12}  # 0.7 and 0.3 of 40
    small = Counter(i for s, i in rows if s == 0)  # 28 rows from 10: two whole passes and 8 rows a third time
    assert sorted(small.values()) == [2] * 2 + [3] * 8 and set(small) == set(range(10))
    big = [i for s, i in rows if s == 1]  # 12 distinct rows of 30
    assert len(set(big)) == 12
    assert [s["rows"] for s in mix.realised()] == [28, 12]
    again = MixtureDataset([Rows(0, 10), Rows(1, 30)], [7, 3], seed=5)  # a fresh object, same (seed, epoch)
    assert [again[i] for i in range(40)] == rows
    mix.set_epoch(1)
    epoch1 = [mix[i] for i in range(40)]
    assert epoch1 != rows and Counter(s for s, _ in epoch1) == {0: 28, 1: 12}
    mix.set_epoch(0)
    assert [mix[i] for i in range(40)] == rows  # resume: epoch 0 again is epoch 0
    assert [MixtureDataset(sources, [0.7, 0.3], seed=6)[i] for i in range(40)] != rows


def test_load_data_spec_with_real_datasets(tokenizer, tmp_path):
    a = write_texts(tmp_path / "a.jsonl", [f"alpha {i} " * (i % 5 + 1) for i in range(12)])
    b = write_texts(tmp_path / "b.jsonl", [f"beta {i}" for i in range(4)])
    made = []

    def make(path):
        made.append(PretrainDataset(path, tokenizer, max_length=8, cache_dir=tmp_path / "cache", num_proc=1))
        return made[-1]

    single = load_data_spec(a, make)
    assert isinstance(single, PretrainDataset) and len(single) == 12
    both = load_data_spec(f"{a},{b}", make)
    assert isinstance(both, ConcatDataset) and len(both) == 16
    assert made[1].cache_path != made[2].cache_path  # each source its own cache
    os.makedirs(tmp_path / "more")
    write_texts(tmp_path / "more" / "c.jsonl", [f"gamma {i} " * 9 for i in range(3)])  # longer than max_length
    write_texts(tmp_path / "more" / "d.jsonl", [f"delta {i}" for i in range(5)])
    mix = load_data_spec(f"{a}:0.5,{tmp_path / 'more'}:0.5", make, seed=1)  # a directory source: c then d
    assert isinstance(mix, MixtureDataset) and [s["rows"] for s in mix.realised()] == [10, 10]
    assert len(mix.sources[1]) == 8  # 10 rows from 8: every row once, 2 of them twice
    # tokens per source, counted independently from the rows the mixture returns
    tokens = [0, 0]
    for i in range(len(mix)):
        input_ids, labels = mix[i]
        tokens[int(mix.source_ids[i])] += int((labels != -100).sum())
    stats = mix.realised()
    assert [s["tokens"] for s in stats] == tokens
    assert stats[0]["token_share"] == pytest.approx(tokens[0] / sum(tokens))
    line = describe_mixture(mix, f"{a}:0.5,{tmp_path / 'more'}:0.5")
    assert line.startswith(f"data mixture realised: {a}: 10 rows (50.0%), {tokens[0]} tokens")
    assert describe_mixture(single, a) == ""


def test_packed_sft_rows_count_their_conversations_not_the_padding(tokenizer, tmp_path):
    path = demo_slice(tmp_path, "sft", 60)
    make = lambda p: SFTDataset(p, tokenizer, max_length=64, cache_dir=tmp_path / "cache", packing=True)  # noqa: E731
    mix = load_data_spec(f"{path}:0.5,{path}:0.5", make, seed=3)
    assert tokenizer.pad_token_id is not None
    tokens = [0, 0]  # the tokens before each row's padding (the chat template never writes the pad token)
    for i in range(len(mix)):
        input_ids, _ = mix[i]
        tokens[int(mix.source_ids[i])] += int((input_ids != tokenizer.pad_token_id).sum())
    assert 0 < sum(tokens) < len(mix) * 64  # rows with padding: the old count (rows x 64) was over
    assert [s["tokens"] for s in mix.realised()] == tokens


def test_absolute_data_spec_keeps_weights_and_follows_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_data_spec("a.jsonl:0.70, shards/*.parquet:0.3") == \
        f"{tmp_path}/a.jsonl:0.7,{tmp_path}/shards/*.parquet:0.3"
    assert absolute_data_spec("/data/x.jsonl") == "/data/x.jsonl"
