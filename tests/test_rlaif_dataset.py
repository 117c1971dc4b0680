"""RLAIFDataset (dataset/rlaif_dataset.py): prompts rendered as the chat template renders them, think blocks opened
by --thinking_ratio from the seed, left padding and truncation, the row's columns, bad rows."""
import json

import pytest
import torch

from dataset.rlaif_dataset import RLAIFDataset
from tests.helpers.launch import write_rows


def rows(n):
    return [{"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Add {i}+{i}."},
                               {"role": "assistant", "content": f"{2 * i}"}], "gt": str(2 * i)} for i in range(n)]


def test_prompts_are_the_conversation_without_its_answer(tmp_path, tokenizer):
    data = rows(6) + [{"conversations": [{"role": "user", "content": "No answer given."}]}]
    ds = RLAIFDataset(write_rows(tmp_path / "r.jsonl", data), tokenizer, max_length=64, thinking_ratio=0.0)
    for i, row in enumerate(data):
        prompt = row["conversations"][:-1] if row["conversations"][-1]["role"] == "assistant" else row["conversations"]
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<think>\n\n</think>\n\n")  # thinking_ratio 0: the think block closed
        # as transformers tokenizes the prompt, and SFT since it cuts its rows there: one "\n\n" after "</think>"
        expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert expected[-2:] == tokenizer.convert_tokens_to_ids(["</think>", "ĊĊ"])
        ids, length, columns = ds[i]
        assert length == len(expected) and ids[64 - len(expected):].tolist() == expected
        assert (ids[:64 - len(expected)] == tokenizer.pad_token_id).all()
        assert json.loads(columns) == dict({k: v for k, v in row.items() if k != "conversations"}, prompt=prompt)


def test_thinking_ratio_opens_the_think_block_in_its_share_from_the_seed(tmp_path, tokenizer):
    path = write_rows(tmp_path / "r.jsonl", rows(200))
    opened = {}
    for seed in (1, 1, 2):
        ds = RLAIFDataset(path, tokenizer, max_length=64, thinking_ratio=0.3, seed=seed)
        think = tokenizer.convert_tokens_to_ids("<think>")
        opened.setdefault(seed, []).append([ds[i][0][-2].item() == think for i in range(len(ds))])
    assert opened[1][0] == opened[1][1] and opened[1][0] != opened[2][0]
    assert 0.2 < sum(opened[1][0]) / 200 < 0.4  # a binomial(200, 0.3) share
    always = RLAIFDataset(path, tokenizer, max_length=64, thinking_ratio=1.0)
    assert all(tokenizer.decode(always[i][0]).endswith("<|im_start|>assistant\n<think>\n") for i in range(200))


def test_long_prompts_keep_their_last_tokens_and_bad_rows_are_named(tmp_path, tokenizer):
    data = rows(3)
    data[1]["conversations"][1]["content"] = "word " * 100
    path = write_rows(tmp_path / "r.jsonl", data)
    ds = RLAIFDataset(path, tokenizer, max_length=32, thinking_ratio=0.0)
    text = tokenizer.apply_chat_template(data[1]["conversations"][:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer(text, add_special_tokens=False)["input_ids"]  # as transformers tokenizes it, SFT too
    assert ds[1][0].tolist() == full[-32:] and ds[1][1] == 32
    assert ds.notes() == [f"1 of 3 prompts of {path} are longer than --max_seq_len 32: their start dropped "
                                 "(each keeps its last 32 tokens)"]  # the line the trainer prints at start
    bad = write_rows(tmp_path / "bad.jsonl", rows(2) + ["{not json", {"text": "x"}, {"conversations": []}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        RLAIFDataset(bad, tokenizer)
    skipped = RLAIFDataset(bad, tokenizer, skip_bad_lines=True)
    assert len(skipped) == 2 and skipped.num_bad_lines == 3
    assert torch.equal(skipped[1][0], RLAIFDataset(write_rows(tmp_path / "ok.jsonl", rows(2)), tokenizer)[1][0])
