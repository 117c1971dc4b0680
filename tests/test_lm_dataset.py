"""PretrainDataset / SFTDataset against hand-built token sequences, plus the cache and the demo data."""
import json
import math
import os
import pickle
import subprocess
import sys
import sysconfig

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

import dataset.chat as chat
import dataset.shards as shards
from dataset.chat import SFTDataset
from dataset.demo.records import stdlib_docstrings
from dataset.demo_data import ensure_demo_data
from dataset.lm_dataset import PretrainDataset
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.chat_rows import (
    CUT,
    GCD_CALLS,
    GCD_TOOLS,
    TOOL_CONVERSATION,
    TOOL_CONVERSATION_PIECES,
    encode,
    pieces_to_ids,
)
from tests.helpers.launch import demo_slice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIMIND3_CONFIG = os.path.join(ROOT, "tests", "fixtures", "minimind3_tokenizer_config.json")
BOS, EOS, PAD = 1, 2, 0

TEXTS = ["Hello world, this is a tiny document.", "你好，世界！", "x = [i ** 2 for i in range(10)]  # squares"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "再说一次"},
    {"role": "assistant", "content": "你好！"},
]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


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


def test_pretrain_packing_doc_mask_positions(tokenizer, tmp_path):
    """Position ids count from 0 at the row start and at each document's bos, computed by hand from the stream."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS * 3])
    ds = PretrainDataset(path, tokenizer, max_length=16, packing=True, cache_dir=tmp_path / "cache", doc_mask=True)
    plain = PretrainDataset(path, tokenizer, max_length=16, packing=True, cache_dir=tmp_path / "cache")
    stream, doc_starts = [], set()
    for text in TEXTS * 3:
        doc_starts.add(len(stream))
        stream += [BOS] + encode(tokenizer, text) + [EOS]
    restarts = 0
    for r in range(len(ds)):
        input_ids, labels, positions = ds[r]
        assert torch.equal(input_ids, plain[r][0]) and torch.equal(labels, plain[r][1])
        expected, position = [], 0
        for i in range(r * 16, (r + 1) * 16):
            position = 0 if i == r * 16 or i in doc_starts else position + 1
            expected.append(position)
        assert positions.tolist() == expected
        restarts += expected[1:].count(0)
    assert restarts >= 2  # the rows do hold several documents


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


def labelled_runs(tokenizer, input_ids, labels):
    """Decoded runs of consecutive labelled tokens."""
    runs, run = [], []
    for token, label in zip(input_ids.tolist() + [PAD], labels.tolist() + [-100]):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs


def hand_built_conversation(tokenizer):
    """CONVERSATION in MiniMind-3's ChatML, written out by hand (an empty think block opens each answer; its
    generation prompt, through "</think>\\n\\n", tokenized apart from the answer)."""
    return pieces_to_ids(tokenizer, [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", True), CUT, ("Hi there.<|im_end|>", True),
        ("\n<|im_start|>user\n再说一次<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", True), CUT, ("你好！<|im_end|>", True),
        ("\n", False),
    ])


def test_sft_labels_only_what_the_assistant_generates(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    ds = SFTDataset(path, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    ids, labels = hand_built_conversation(tokenizer)
    input_ids, got_labels = ds[0]
    assert input_ids.tolist() == ids + [PAD] * (64 - len(ids))
    assert got_labels.tolist() == labels + [-100] * (64 - len(ids))
    assert labelled_runs(tokenizer, input_ids, got_labels) == \
        ["<think>\n\n</think>\n\nHi there.<|im_end|>", "<think>\n\n</think>\n\n你好！<|im_end|>"]


def test_sft_truncation(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    ids, labels = hand_built_conversation(tokenizer)
    n = len(ids) - 3  # cuts into the second answer
    input_ids, got_labels = SFTDataset(path, tokenizer, max_length=n, cache_dir=tmp_path / "cache")[0]
    assert input_ids.tolist() == ids[:n] and got_labels.tolist() == labels[:n]


LONG_QUESTION = "Tell me about the sea. " * 20
LONG_CONVERSATION = [{"role": "user", "content": LONG_QUESTION}, {"role": "assistant", "content": "Blue."}]


def test_sft_rows_without_an_assistant_token_are_counted(tokenizer, tmp_path, monkeypatch):
    _, labels = hand_built_conversation(tokenizer)
    _, long_labels = pieces_to_ids(tokenizer, [
        (f"<|im_start|>user\n{LONG_QUESTION}<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", True), CUT, ("Blue.<|im_end|>", True), ("\n", False)])
    first = next(i for i, label in enumerate(labels) if label != -100)  # position of the first target
    long_first = next(i for i, label in enumerate(long_labels) if label != -100)
    assert first < long_first
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": c} for c in (CONVERSATION, LONG_CONVERSATION,
                                                                              CONVERSATION)])
    # the shifted loss uses labels 1..L-1 of a row: its first target counts once L > its position
    ds = SFTDataset(path, tokenizer, max_length=first + 1, cache_dir=tmp_path / "cache")
    assert (ds.num_rows_without_targets, len(ds)) == (1, 3)
    assert ds.no_target_line() == (f"1 of 3 rows of {path} have no assistant token within --max_seq_len {first + 1}; "
                                   "they teach nothing")
    monkeypatch.setattr(chat, "SCAN_TOKENS", 1)  # one row per scanned block: the same count
    assert SFTDataset(path, tokenizer, max_length=first + 1, cache_dir=tmp_path / "cache").num_rows_without_targets == 1
    full = SFTDataset(path, tokenizer, max_length=long_first + 1, cache_dir=tmp_path / "cache")
    assert full.num_rows_without_targets == 0 and full.no_target_line() is None
    with pytest.raises(ValueError) as error:
        SFTDataset(path, tokenizer, max_length=first, cache_dir=tmp_path / "cache")
    assert str(error.value) == (f"no row of {path} has an assistant token within --max_seq_len {first}; "
                                "raise --max_seq_len")


def minimind3_tokenizer(tmp_path):
    """A tokenizer folder in MiniMind-3's format: its tokenizer_config.json (added tokens, chat template)
    verbatim from tests/fixtures, and a small byte-level BPE trained here with its 36 added tokens."""
    with open(MINIMIND3_CONFIG, encoding="utf-8") as f:
        config = json.load(f)
    added = config["added_tokens_decoder"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[added[str(i)]["content"] for i in range(len(added))],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(TEXTS + [text for text, _ in TOOL_CONVERSATION_PIECES], trainer=trainer)
    bpe.decoder = decoders.ByteLevel()
    state = json.loads(bpe.to_str())
    for entry in state["added_tokens"]:  # MiniMind-3's flags: tags and buffers are not special
        entry["special"] = added[str(entry["id"])]["special"]
    folder = tmp_path / "minimind3_tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(state), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("tokenizer_format", ["ours", "minimind3"])
def test_pretrain_stream_is_tokenizer_encode_of_each_document(tokenizer, tokenizer_format, tmp_path):
    """The cache (built through the backend's batch API) holds bos + tokenizer.encode(text) + eos per document: the
    demo corpus, and texts with MiniMind-3's tags (<think>, <tool_call>, <|im_start|>), which are added tokens."""
    tok = tokenizer if tokenizer_format == "ours" else minimind3_tokenizer(tmp_path)
    with open(ensure_demo_data("pretrain"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:2000]
    texts += [text for text, _ in TOOL_CONVERSATION_PIECES] + ["<think>\n嗯</think> <tool_call>{}</tool_call>"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    stream = []
    for text in texts:
        stream += [tok.bos_token_id] + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    ds = PretrainDataset(path, tok, max_length=len(stream), packing=True, cache_dir=tmp_path / "cache")
    assert len(ds) == 1 and ds[0][0].tolist() == stream
    assert tok.convert_tokens_to_ids("<think>") in stream and tok.convert_tokens_to_ids("<tool_call>") in stream


@pytest.mark.parametrize("tokenizer_format", ["ours", "minimind3"])
def test_sft_tool_call_conversation_hand_checked(tokenizer, tokenizer_format, tmp_path):
    """Rendering and labels of a reasoning + tool-call conversation, token by token, with our tokenizer and
    with a MiniMind-3-format one: the same text, the assistant's generated spans only."""
    tok = tokenizer if tokenizer_format == "ours" else minimind3_tokenizer(tmp_path)
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<think>", "</think>"]) == [21, 22, 25, 26]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"conversations": TOOL_CONVERSATION}])
    ds = SFTDataset(path, tok, max_length=320, cache_dir=tmp_path / "cache")
    ids, labels = pieces_to_ids(tok, TOOL_CONVERSATION_PIECES)
    assert len(ids) <= 320
    input_ids, got_labels = ds[0]
    assert tok.decode(input_ids[:len(ids)]) == "".join(text for text, _ in TOOL_CONVERSATION_PIECES)
    assert input_ids.tolist() == ids + [tok.pad_token_id] * (320 - len(ids))
    assert got_labels.tolist() == labels + [-100] * (320 - len(ids))
    expected_runs = [text for text, labelled in TOOL_CONVERSATION_PIECES if labelled]
    assert labelled_runs(tok, input_ids, got_labels) == expected_runs


def test_sft_tools_as_json_strings_or_lists_are_the_same(tokenizer, tmp_path):
    as_lists = [dict(m) for m in TOOL_CONVERSATION]
    as_lists[0]["tools"], as_lists[2]["tool_calls"] = GCD_TOOLS, GCD_CALLS
    strings = SFTDataset(write_jsonl(tmp_path / "strings.jsonl", [{"conversations": TOOL_CONVERSATION}]),
                         tokenizer, max_length=320, cache_dir=tmp_path / "cache")
    lists = SFTDataset(write_jsonl(tmp_path / "lists.jsonl", [{"conversations": as_lists}]),
                       tokenizer, max_length=320, cache_dir=tmp_path / "cache")
    assert all(torch.equal(a, b) for a, b in zip(strings[0], lists[0]))
    # parquet (null-filled struct fields, as `datasets` reads sft_t2t) gives the same sample as well
    parquet = str(tmp_path / "tools.parquet")
    pd.DataFrame({"conversations": [TOOL_CONVERSATION, CONVERSATION]}).to_parquet(parquet)
    from_parquet = SFTDataset(parquet, tokenizer, max_length=320, cache_dir=tmp_path / "cache")
    assert all(torch.equal(a, b) for a, b in zip(strings[0], from_parquet[0]))


def test_sft_plain_chatml_template(tmp_path):
    """A template without think blocks (MiniMind2-era plain ChatML): exactly content + eos is labelled."""
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION}])
    input_ids, labels = SFTDataset(path, tok, max_length=96, cache_dir=tmp_path / "cache")[0]
    assert labelled_runs(tok, input_ids, labels) == ["Hi there.<|im_end|>", "你好！<|im_end|>"]


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


# ----------------------------------------------------------------------------- packed SFT

SHORT_CONVERSATION = CONVERSATION[1:3]  # user "Say hi.", assistant "Hi there."
TINY_CONVERSATION = CONVERSATION[3:5]  # user "再说一次", assistant "你好！"


def one_turn(user, answer):
    """(ids, labels) of a user + assistant conversation, written out by hand."""
    return pieces_to_ids(AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")), [
        (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", True), CUT, (f"{answer}<|im_end|>", True), ("\n", False)])


def test_sft_packing_three_conversations_by_hand(tokenizer, tmp_path):
    """Best fit decreasing: the longest conversation (a) opens row 0, the next (c) does not fit beside it and opens
    row 1, the shortest (b) fills row 0 exactly. Labels are each conversation's own; positions restart at each."""
    a, b, c = hand_built_conversation(tokenizer), one_turn("Say hi.", "Hi there."), one_turn("再说一次", "你好！")
    assert len(a[0]) > len(c[0]) > len(b[0])
    length = len(a[0]) + len(b[0])
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": x}
                                              for x in (CONVERSATION, SHORT_CONVERSATION, TINY_CONVERSATION)])
    ds = SFTDataset(path, tokenizer, max_length=length, cache_dir=tmp_path / "cache", packing=True, doc_mask=True)
    assert len(ds) == 2
    pad = length - len(c[0])
    rows = [(a[0] + b[0], a[1] + b[1], list(range(len(a[0]))) + list(range(len(b[0])))),
            (c[0] + [PAD] * pad, c[1] + [-100] * pad, list(range(len(c[0]))) + list(range(pad)))]
    for r, (ids, labels, positions) in enumerate(rows):
        input_ids, got_labels, got_positions = ds[r]
        assert input_ids.tolist() == ids and got_labels.tolist() == labels and got_positions.tolist() == positions
    assert labelled_runs(tokenizer, *ds[0][:2]) == ["<think>\n\n</think>\n\nHi there.<|im_end|>",
                                                    "<think>\n\n</think>\n\n你好！<|im_end|>",
                                                    "<think>\n\n</think>\n\nHi there.<|im_end|>"]
    plain = SFTDataset(path, tokenizer, max_length=length, cache_dir=tmp_path / "cache", packing=True)
    assert [len(x) for x in plain[0]] == [length, length] and torch.equal(plain[0][1], ds[0][1])  # no positions


def segments(positions):
    """[start, end) of each run of positions counting up from 0."""
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return list(zip(starts[:-1], starts[1:]))


def test_sft_packing_keeps_every_conversation_whole_once(tokenizer, tmp_path, monkeypatch):
    """Demo chat rows at a length that truncates some: every conversation with a target is one segment of one
    packed row, equal to its padded sample; rows are full within best-fit decreasing's bound; one cache serves both."""
    path = demo_slice(tmp_path, "sft", 800)
    padded = SFTDataset(path, tokenizer, max_length=96, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(shards, "_build_cache", lambda *a, **k: pytest.fail("packing rebuilt the token cache"))
    packed = SFTDataset(path, tokenizer, max_length=96, cache_dir=tmp_path / "cache", packing=True, doc_mask=True)
    expected = []
    for i in range(len(padded)):
        ids, labels = padded[i]
        n = int((ids != PAD).sum()) if ids[-1] == PAD else len(ids)  # pad is never inside a conversation
        if (labels[1:n] != -100).any():
            expected.append((tuple(ids[:n].tolist()), tuple(labels[:n].tolist())))
    assert 0 < len(expected) < len(padded)  # some truncated conversations lose every target
    got, used = [], 0
    for r in range(len(packed)):
        ids, labels, positions = packed[r]
        spans = segments(positions.tolist())
        real = spans if ids[-1] != PAD else spans[:-1]  # the padding is a segment of its own
        got += [(tuple(ids[a:b].tolist()), tuple(labels[a:b].tolist())) for a, b in real]
        used += sum(b - a for a, b in real)
    assert sorted(got) == sorted(expected)
    assert len(packed) <= math.ceil(11 / 9 * math.ceil(used / 96)) + 1  # BFD <= 11/9 OPT + 6/9 rows
    assert packed.no_target_line() == (
        f"{len(padded) - len(expected)} of {len(padded)} conversations of {path} have no assistant token within "
        "--max_seq_len 96; they teach nothing and are left out of the packed rows")


def test_sft_packing_no_target_rules(tokenizer, tmp_path):
    """Packing keeps the padded rules: counted, left out of the rows; nothing at all to learn is an error."""
    _, labels = hand_built_conversation(tokenizer)
    first = next(i for i, label in enumerate(labels) if label != -100)
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": c} for c in (CONVERSATION, LONG_CONVERSATION)])
    ds = SFTDataset(path, tokenizer, max_length=first + 1, cache_dir=tmp_path / "cache", packing=True)
    assert (ds.num_rows_without_targets, len(ds)) == (1, 1)
    assert ds[0][0].tolist() == hand_built_conversation(tokenizer)[0][:first + 1]
    with pytest.raises(ValueError, match="no row of .* has an assistant token within --max_seq_len"):
        SFTDataset(path, tokenizer, max_length=first, cache_dir=tmp_path / "cache", packing=True)


def test_sft_packed_row_loss_is_the_sum_of_its_conversations(tokenizer, tmp_path):
    """Through the real model (fp32): a packed row's summed CE equals its conversations' CE, each alone and padded,
    per target token too: the document mask and restarting positions keep conversations apart."""
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": x} for x in (
        CONVERSATION, SHORT_CONVERSATION, TINY_CONVERSATION, TOOL_CONVERSATION, LONG_CONVERSATION)])
    length = 352
    packed = SFTDataset(path, tokenizer, max_length=length, cache_dir=tmp_path / "cache", packing=True, doc_mask=True)
    alone = SFTDataset(path, tokenizer, max_length=length, cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    # initializer_range 0.3: peaked attention, so a token's loss depends on what it sees (0.02 barely would)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, loss_chunk_size=0, initializer_range=0.3)).eval()
    rows = [packed[r] for r in range(len(packed))]
    assert len(rows) < len(alone) and sum(len(segments(p.tolist())) for *_, p in rows) > len(rows)
    with torch.no_grad():
        ids, labels, positions = map(torch.stack, zip(*rows))
        out = model(ids, position_ids=positions, labels=labels, num_items_in_batch=1)
        packed_tokens = token_losses(out.logits, labels)
        singles = [model(x[None], labels=y[None], num_items_in_batch=1) for x, y in (alone[i] for i in range(5))]
        unmasked = float(model(ids, labels=labels, num_items_in_batch=1).loss)  # rows as single sequences
    expected = sum(float(s.loss) for s in singles)
    # fp32: each token's CE carries ~1e-6 relative error from differently ordered sums; about a hundred tokens
    assert float(out.loss) == pytest.approx(expected, rel=1e-5)
    assert abs(unmasked / expected - 1) > 1e-3  # without the document mask the sum would differ: the test can tell
    alone_tokens = torch.cat([token_losses(s.logits, alone[i][1][None]) for i, s in enumerate(singles)])
    torch.testing.assert_close(packed_tokens.sort().values, alone_tokens.sort().values, rtol=1e-5, atol=1e-5)


def token_losses(logits, labels):
    """The CE of every target token of a batch (labels shifted as the model does)."""
    targets = labels[:, 1:].reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="none",
                                           ignore_index=-100)
    return ce[targets != -100]


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
        m.setattr(shards, "_build_cache", no_rebuild)
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


def test_bad_tool_rows(tokenizer, tmp_path):
    broken_calls = [dict(m) for m in TOOL_CONVERSATION]
    broken_calls[2]["tool_calls"] = '[{"name": "gcd", "arguments": '  # cut-off JSON
    broken_tools = [dict(m) for m in TOOL_CONVERSATION]
    broken_tools[0]["tools"] = {"name": "gcd"}
    rows = [{"conversations": TOOL_CONVERSATION}, {"conversations": broken_calls},
            {"conversations": CONVERSATION}, {"conversations": broken_tools}]
    path = write_jsonl(tmp_path / "bad_tools.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad_tools\.jsonl:2: message 2: 'tool_calls' is not valid JSON"):
        SFTDataset(path, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    path = write_jsonl(tmp_path / "bad_tools.jsonl", [rows[0], rows[2], rows[3]])
    with pytest.raises(ValueError, match=r"bad_tools\.jsonl:3: message 0: 'tools' must be a list"):
        SFTDataset(path, tokenizer, max_length=64, cache_dir=tmp_path / "cache")
    path = write_jsonl(tmp_path / "bad_tools.jsonl", rows)
    ds = SFTDataset(path, tokenizer, max_length=320, skip_bad_lines=True, cache_dir=tmp_path / "cache")
    assert len(ds) == 2 and ds.num_bad_lines == 2
    good = SFTDataset(write_jsonl(tmp_path / "good.jsonl", [rows[0], rows[2]]), tokenizer, max_length=320,
                      cache_dir=tmp_path / "cache")
    assert all(torch.equal(a, b) for i in range(2) for a, b in zip(ds[i], good[i]))


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
    for name in ("pretrain_demo.jsonl", "sft_demo_v2.jsonl"):
        with open(tmp_path / "run0" / name, "rb") as a, open(tmp_path / "run1" / name, "rb") as b:
            assert a.read() == b.read()
    with open(tmp_path / "run0" / "sft_demo_v2.jsonl", encoding="utf-8") as f:
        conversations = [json.loads(line)["conversations"] for line in f]
    assert len(conversations) > 1000
    tool_rows = [c for c in conversations if c[0]["role"] == "system"]
    reasoning_rows = [c for c in conversations if c[0]["role"] == "user" and "reasoning_content" in c[1]]
    assert len(tool_rows) == len(reasoning_rows) == 48
    for conv in conversations:
        if conv in tool_rows:
            assert [m["role"] for m in conv] == ["system", "user", "assistant", "tool", "assistant"]
        else:
            assert [m["role"] for m in conv] == ["user", "assistant"] * (len(conv) // 2)
    # tool results are the standard library's answers, e.g. gcd(a, b) for the gcd tool
    for conv in tool_rows:
        calls = conv[2]["tool_calls"]
        call = (json.loads(calls) if isinstance(calls, str) else calls)[0]
        if call["name"] == "gcd":
            assert json.loads(conv[3]["content"]) == {"gcd": math.gcd(call["arguments"]["a"], call["arguments"]["b"])}
    assert {isinstance(c[0]["tools"], str) for c in tool_rows} == {True, False}  # JSON strings and lists
    with open(tmp_path / "run0" / "pretrain_demo.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) > 1000 and sum(map(len, texts)) > 500_000
    assert any("你好" in t for t in texts)  # the Chinese dialogues are mixed in
    assert any("Content-Type" in t for t in texts)  # and the email package's docstrings


def test_ensure_demo_data_builds_once(tmp_path):
    path = ensure_demo_data("sft", tmp_path)
    assert path == os.path.join(tmp_path, "sft_demo_v2.jsonl") and os.path.getsize(path) > 0
    mtime = os.stat(path).st_mtime_ns
    assert ensure_demo_data("sft", tmp_path) == path and os.stat(path).st_mtime_ns == mtime


def test_demo_tool_rows_fit_the_default_sft_length(tokenizer, tmp_path):
    """Every tool-call and reasoning row of the SFT demo is whole within train_sft.py's default
    --max_seq_len 340, so the default run learns its final answer and <|im_end|>."""
    path = ensure_demo_data("sft", tmp_path)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line)["conversations"] for line in f]
    ds = SFTDataset(path, tokenizer, max_length=340, cache_dir=tmp_path / "cache")
    special_rows = [i for i, conv in enumerate(rows) if any("reasoning_content" in m for m in conv)]
    assert len(special_rows) == 96
    for i in special_rows:
        input_ids, labels = ds[i]
        runs = labelled_runs(tokenizer, input_ids, labels)
        assert len(runs) == sum(m["role"] == "assistant" for m in rows[i])
        assert runs[-1].endswith(rows[i][-1]["content"] + "<|im_end|>")


def test_stdlib_docstrings_limit_is_the_walks_prefix():
    """limit=k: the first k docstrings of the whole walk (the GPU check's dry run takes the first 113 and parses no
    more files than they need)."""
    stdlib_dir = os.path.join(sysconfig.get_paths()["stdlib"], "email")
    whole = stdlib_docstrings(stdlib_dir)
    assert len(whole) > 20
    for k in (0, 1, 7, len(whole), len(whole) + 5):
        assert stdlib_docstrings(stdlib_dir, limit=k) == whole[:k]
