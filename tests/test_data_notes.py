"""The datasets' notes() (dataset/chat.py, preference_data.py): what a chat or preference dataset loses or lacks is
counted in one line each, and DPO pairs that teach nothing (chosen == rejected) are counted, or refused when every pair
is one."""

import pytest

from dataset.chat import SFTDataset
from dataset.preference_data import DPODataset, RewardPairs
from tests.helpers.launch import TINY_MODEL, run_in_process, write_rows
from trainer import train_dpo
from trainer.observe.console import rows_line


def conversation(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def pairs(n, same=()):
    """n pairs; the ones in `same` have rejected == chosen."""
    return [{"chosen": conversation(f"What is {i} + {i}?", f"{2 * i}."),
             "rejected": conversation(f"What is {i} + {i}?", f"{2 * i}." if i in same else f"{2 * i + 1}, I think.")}
            for i in range(n)]


def test_identical_pairs_are_counted(tmp_path, tokenizer):
    data = write_rows(tmp_path / "d.jsonl", pairs(8, same=(1, 4, 6)))
    ds = DPODataset(data, tokenizer, max_length=48, cache_dir=tmp_path / "c")
    assert ds.identical_rows.tolist() == [1, 4, 6] and ds.pairs.tolist() == [0, 2, 3, 5, 7]  # left out
    assert ds.notes() == [f"3 of 8 pairs of {data} have chosen == rejected (within --max_seq_len 48): they "
                                 "teach nothing and are left out"]


def test_the_reward_models_identical_pairs_are_left_out_with_their_margins(tmp_path, tokenizer):
    """RewardPairs (train_reward) reads DPO's pairs: the same note, and each kept pair keeps its own margin."""
    rows = [dict(row, margin=float(i)) for i, row in enumerate(pairs(6, same=(0, 3)))]
    data = write_rows(tmp_path / "r.jsonl", rows)
    ds = RewardPairs(data, tokenizer, max_length=48, cache_dir=tmp_path / "c")
    assert len(ds) == 4 and [float(ds[i][2]) for i in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert ds.notes() == [f"2 of 6 pairs of {data} have chosen == rejected (within --max_seq_len 48): they "
                                 "teach nothing and are left out"]


def test_pairs_that_differ_only_past_max_seq_len_are_identical_as_trained(tmp_path, tokenizer):
    """A pair whose answers part after the row ends trains as two equal rows: a margin of 0 whatever the model."""
    long = "All of this is the same up to here. " * 10
    rows = pairs(4)
    rows[2]["chosen"][1]["content"], rows[2]["rejected"][1]["content"] = long + "Yes.", long + "No."
    ds = DPODataset(write_rows(tmp_path / "d.jsonl", rows), tokenizer, max_length=48, cache_dir=tmp_path / "c")
    assert ds.identical_rows.tolist() == [2] and len(ds) == 3
    wide = DPODataset(write_rows(tmp_path / "d.jsonl", rows), tokenizer, max_length=256, cache_dir=tmp_path / "c")
    assert wide.identical_rows.tolist() == [] and len(wide) == 4


def test_all_identical_pairs_are_one_error_line_before_training(tmp_path, monkeypatch, capsys):
    data = write_rows(tmp_path / "same.jsonl", pairs(8, same=range(8)))
    out = tmp_path / "out"
    code, err = run_in_process(monkeypatch, capsys, train_dpo, [
        *TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "48", "--batch_size", "2",
        "--save_dir", out, "--checkpoint_dir", out / "ckpt", "--cache_dir", out / "cache"])
    assert code == 2 and err == [
        f"error: 8 of 8 pairs of {data} have chosen == rejected (within --max_seq_len 48): they teach nothing; give "
        "each pair a rejected answer that differs from the chosen one"]
    assert not list((out / "cache").glob("*.dpo_ref.*"))  # stopped before the reference model ran


@pytest.mark.parametrize("packing", [False, True])
def test_conversations_cut_at_max_seq_len_are_counted(tmp_path, tokenizer, packing):
    """The count is that of conversations whose chat-template tokens (counted here by transformers) exceed the row."""
    rows = [{"conversations": conversation(f"Question {i}?", "Short." if i % 3 else "A long answer. " * (4 + i))}
            for i in range(12)]
    data = write_rows(tmp_path / "sft.jsonl", rows)
    lengths = [len(tokenizer(tokenizer.apply_chat_template(r["conversations"], tokenize=False),
                             add_special_tokens=False).input_ids) for r in rows]
    longer = sum(n > 40 for n in lengths)
    assert 0 < longer < len(rows)
    ds = SFTDataset(data, tokenizer, max_length=40, cache_dir=tmp_path / "c", packing=packing)
    assert f"{longer} of 12 conversations of {data} are longer than --max_seq_len 40: cut, their answers lose the " \
           "end" in ds.notes()
    wide = SFTDataset(data, tokenizer, max_length=max(lengths), cache_dir=tmp_path / "c", packing=packing)
    assert wide.notes() == []


def test_the_data_line_counts_the_conversations_it_packs(tmp_path, tokenizer):
    """Packed SFT leaves out the conversations without a target within the row: the Data line counts the 5 it packs,
    not the file's 7 (it said 'packed from 7' right after '2 of 7 ... are left out')."""
    rows = [{"conversations": conversation(f"Hi {i}?", "Hello.")} for i in range(5)]
    rows += [{"conversations": conversation("word " * 60, "Yes.")} for _ in range(2)]  # the answer past 32 tokens
    data = write_rows(tmp_path / "sft.jsonl", rows)
    ds = SFTDataset(data, tokenizer, max_length=32, cache_dir=tmp_path / "c", packing=True)
    assert ds.notes()[0].startswith(f"2 of 7 conversations of {data} have no assistant token within --max_seq_len 32")
    assert rows_line(ds, 32) == f"{len(ds)} rows of 32 tokens packed from 5 conversations"
