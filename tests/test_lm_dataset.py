"""PretrainDataset / SFTDataset against hand-built token sequences, plus the cache and the demo data."""
import json
import os
import pickle
import subprocess
import sys
import sysconfig

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import dataset.lm_dataset as lm_dataset
from dataset.demo_data import ensure_demo_data
from dataset.lm_dataset import PretrainDataset, SFTDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOS, EOS, PAD = 1, 2, 0

TEXTS = ["Hello world, this is a tiny document.", "你好，世界！", "x = [i ** 2 for i in range(10)]  # squares"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "再说一次"},
    {"role": "assistant", "content": "你好！"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- pretraining

def test_pretrain_sample_is_bos_text_eos_then_padding(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    ds = PretrainDataset(path, tokenizer, max_length=32, cache_dir=tmp_path / "cache")
    assert len(ds) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        tokens = [BOS] + encode(tokenizer, text) + [EOS]
        expected_ids = tokens + [PAD] * (32 - len(tokens))
        expected_labels = tokens + [-100] * (32 - len(tokens))
        input_ids, labels = ds[i]
        assert input_ids.dtype == labels.dtype == torch.long
        assert input_ids.tolist() == expected_ids
        assert labels.tolist() == expected_labels


def test_pretrain_truncation_keeps_eos(tokenizer, tmp_path):
    text = "one two three four five six seven eight nine ten eleven twelve"
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": text}])
    ds = PretrainDataset(path, tokenizer, max_length=8, cache_dir=tmp_path / "cache")
    expected = [BOS] + encode(tokenizer, text)[:6] + [EOS]
    input_ids, labels = ds[0]
    assert input_ids.tolist() == expected and labels.tolist() == expected


def test_pretrain_packing_rows(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS * 3])
    ds = PretrainDataset(path, tokenizer, max_length=16, packing=True, cache_dir=tmp_path / "cache")
    stream = []
    for text in TEXTS * 3:
        stream += [BOS] + encode(tokenizer, text) + [EOS]
    assert len(ds) == len(stream) // 16
    for r in range(len(ds)):
        input_ids, labels = ds[r]
        assert input_ids.tolist() == stream[r * 16:(r + 1) * 16]
        assert labels.tolist() == stream[r * 16:(r + 1) * 16]


def test_pretrain_parquet_equals_jsonl(tokenizer, tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    parquet = str(tmp_path / "p.parquet")
    pd.DataFrame({"text": TEXTS, "other": [1, 2, 3]}).to_parquet(parquet)
    a = PretrainDataset(jsonl, tokenizer, max_length=24, cache_dir=tmp_path / "cache")
    b = PretrainDataset(parquet, tokenizer, max_length=24, cache_dir=tmp_path / "cache")
    assert len(a) == len(b) == 3
    for i in range(3):
        assert all(torch.equal(x, y) for x, y in zip(a[i], b[i]))


# ----------------------------------------------------------------------------- SFT

def hand_built_conversation(tokenizer):
    """ChatML written out by hand, in (text, labelled) pieces; boundaries fall on special tokens or '\\n'."""
    pieces = [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("Hi there.<|im_end|>", True),
        ("\n<|im_start|>user\n再说一次<|im_end|>\n<|im_start|>assistant\n", False),
        ("你好！<|im_end|>", True),
        ("\n", False),
    ]
    ids, labels = [], []
    for text, labelled in pieces:
        piece_ids = encode(tokenizer, text)
        ids += piece_ids
        labels += piece_ids if labelled else [-100] * len(piece_ids)
    # the pieces tokenize the same separately as together, so this is the dataset's tokenization too
    assert ids == encode(tokenizer, "".join(text for text, _ in pieces))
    return ids, labels


def test_sft_labels_only_assistant_content_and_im_end(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    ds = SFTDataset(path, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    ids, labels = hand_built_conversation(tokenizer)
    input_ids, got_labels = ds[0]
    assert input_ids.tolist() == ids + [PAD] * (64 - len(ids))
    assert got_labels.tolist() == labels + [-100] * (64 - len(ids))
    # decoded labelled runs are exactly the assistant contents, each closed by <|im_end|>
    runs, run = [], []
    for token, label in zip(input_ids.tolist(), got_labels.tolist()):
        if label != -100:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    assert runs == ["Hi there.<|im_end|>", "你好！<|im_end|>"]


def test_sft_truncation(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    ids, labels = hand_built_conversation(tokenizer)
    n = len(ids) - 3  # cuts into the second answer
    input_ids, got_labels = SFTDataset(path, tokenizer, max_length=n, cache_dir=tmp_path / "cache")[0]
    assert input_ids.tolist() == ids[:n] and got_labels.tolist() == labels[:n]


def test_sft_with_think_template(tokenizer, tmp_path):
    """A MiniMind-style template that wraps answers in an empty <think></think>: only content+eos is labelled."""
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    input_ids, labels = SFTDataset(path, tok, max_length=96, cache_dir=tmp_path / "cache")[0]
    labelled = labels[labels != -100].tolist()
    assert labelled == encode(tok, "Hi there.<|im_end|>") + encode(tok, "你好！<|im_end|>")


def test_sft_parquet_equals_jsonl(tokenizer, tmp_path):
    convs = [CONVERSATION, CONVERSATION[1:3]]
    jsonl = write_jsonl(tmp_path / "s.jsonl", [{"conversations": c} for c in convs])
    parquet = str(tmp_path / "s.parquet")
    pd.DataFrame({"conversations": convs}).to_parquet(parquet)
    a = SFTDataset(jsonl, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    b = SFTDataset(parquet, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    assert len(a) == len(b) == 2
    for i in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a[i], b[i]))


# ----------------------------------------------------------------------------- cache

def test_cache_is_reused_and_invalidated(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    first = PretrainDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")
    files = sorted(os.listdir(first.cache_path))
    mtimes = [os.stat(os.path.join(first.cache_path, f)).st_mtime_ns for f in files]
    assert "tokens.bin" in files and "offsets.bin" in files

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache was rebuilt")

    with monkeypatch.context() as m:
        m.setattr(lm_dataset, "_build_cache", no_rebuild)
        second = PretrainDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")
    assert second.cache_path == first.cache_path
    assert [os.stat(os.path.join(first.cache_path, f)).st_mtime_ns for f in files] == mtimes
    assert all(torch.equal(a, b) for i in range(len(first)) for a, b in zip(first[i], second[i]))
    # a changed file gets a new cache
    write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS + ["one more"]])
    third = PretrainDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")
    assert third.cache_path != first.cache_path and len(third) == 4
    # picklable for DataLoader workers, without dragging the memmap along
    clone = pickle.loads(pickle.dumps(third))
    assert clone._tokens is None and torch.equal(clone[3][0], third[3][0])


# ----------------------------------------------------------------------------- bad input

def test_bad_lines_raise_with_file_and_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl",
                       [{"text": "fine"}, '{"text": "unterminated', {"txt": "x"}, {"text": "ok"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        PretrainDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "ok"}, {"txt": "x"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: no 'text' field"):
        PretrainDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")
    path = write_jsonl(tmp_path / "bad_sft.jsonl", [{"conversations": CONVERSATION}, {"text": "not a chat"}])
    with pytest.raises(ValueError, match=r"bad_sft\.jsonl:2: no 'conversations' field"):
        SFTDataset(path, tokenizer, max_length=16, cache_dir=tmp_path / "cache")


def test_skip_bad_lines_counts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl",
                       [{"text": "fine"}, "{not json", {"txt": "x"}, {"text": 5}, {"text": "ok"}])
    ds = PretrainDataset(path, tokenizer, max_length=16, skip_bad_lines=True, cache_dir=tmp_path / "cache")
    assert len(ds) == 2 and ds.num_bad_lines == 3
    assert ds[1][0].tolist()[:len(encode(tokenizer, "ok")) + 2] == [BOS] + encode(tokenizer, "ok") + [EOS]
    path = write_jsonl(tmp_path / "bad_sft.jsonl",
                       [{"conversations": CONVERSATION}, {"conversations": []}, {"conversations": [{"role": "user"}]}])
    ds = SFTDataset(path, tokenizer, max_length=64, skip_bad_lines=True, cache_dir=tmp_path / "cache")
    assert len(ds) == 1 and ds.num_bad_lines == 2


def test_missing_and_empty_files(tokenizer, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PretrainDataset(missing, tokenizer, cache_dir=tmp_path / "cache")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="empty.jsonl"):
        PretrainDataset(empty, tokenizer, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="empty.jsonl"):
        SFTDataset(empty, tokenizer, cache_dir=tmp_path / "cache")


# ----------------------------------------------------------------------------- demo data

def test_demo_data_is_deterministic(tmp_path):
    """Two fresh processes (different hash seeds, cwd elsewhere) write byte-identical corpora.

    Docstrings come from one stdlib package (email, with subpackages) to keep this fast;
    the walk, pydoc topics, dialogues and shuffle are the same code as the full build.
    """
    stdlib_dir = os.path.join(sysconfig.get_paths()["stdlib"], "email")
    code = ("import sys; sys.path.insert(0, %r); from dataset.demo_data import build_demo_data; "
            "build_demo_data('pretrain', sys.argv[1], stdlib_dir=%r); build_demo_data('sft', sys.argv[1])"
            % (ROOT, stdlib_dir))
    procs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        out.mkdir()
        env = dict(os.environ, PYTHONHASHSEED=str(i + 1), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=str(tmp_path), env=env))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for name in ("pretrain_demo.jsonl", "sft_demo.jsonl"):
        with open(tmp_path / "run0" / name, "rb") as a, open(tmp_path / "run1" / name, "rb") as b:
            assert a.read() == b.read()
    with open(tmp_path / "run0" / "sft_demo.jsonl", encoding="utf-8") as f:
        conversations = [json.loads(line)["conversations"] for line in f]
    assert len(conversations) > 1000
    for conv in conversations:
        assert [m["role"] for m in conv] == ["user", "assistant"] * (len(conv) // 2)
    with open(tmp_path / "run0" / "pretrain_demo.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) > 1000 and sum(map(len, texts)) > 500_000
    assert any("你好" in t for t in texts)  # the Chinese dialogues are mixed in
    assert any("Content-Type" in t for t in texts)  # and the email package's docstrings


def test_ensure_demo_data_builds_once(tmp_path):
    path = ensure_demo_data("sft", tmp_path)
    assert path == os.path.join(tmp_path, "sft_demo.jsonl") and os.path.getsize(path) > 0
    mtime = os.stat(path).st_mtime_ns
    assert ensure_demo_data("sft", tmp_path) == path and os.stat(path).st_mtime_ns == mtime
