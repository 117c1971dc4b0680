"""The committed tokenizer (model/tokenizer.json + tokenizer_config.json) loads and behaves like MiniMind-3's."""
import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from transformers import AutoTokenizer

from scripts.train_tokenizer import tokenizer_config
from tests.helpers.launch import TINY_MODEL, forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "model")
MINIMIND3_CONFIG = os.path.join(ROOT, "tests", "fixtures", "minimind3_tokenizer_config.json")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 6400
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tokenizer.pad_token, tokenizer.unk_token) == ("<|endoftext|>", "<|endoftext|>")
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert ids == (0, 0, 1, 2)
    assert tokenizer.model_max_length == 32768


def test_added_tokens_have_minimind3_ids_and_flags(tokenizer):
    """Ids 0-35 hold MiniMind-3's added tokens (its public tokenizer_config.json, tests/fixtures)."""
    with open(MINIMIND3_CONFIG, encoding="utf-8") as f:
        reference = json.load(f)["added_tokens_decoder"]
    assert len(reference) == 36
    for token_id, entry in reference.items():
        assert tokenizer.convert_tokens_to_ids(entry["content"]) == int(token_id)
        assert tokenizer.encode(entry["content"]) == [int(token_id)]  # one token, never split
    assert tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                            "<think>", "</think>", "<|buffer1|>", "<|buffer9|>"]) == \
        [21, 22, 23, 24, 25, 26, 27, 35]
    # tags are not special: skipping special tokens on decode keeps reasoning and tool calls parseable
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == \
        "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"


def test_special_tokens_are_single_ids_and_not_added_by_default(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    # MiniMind's tokenizer adds no bos/eos on its own: the datasets add them explicitly
    assert tokenizer("hello world").input_ids == tokenizer("hello world", add_special_tokens=False).input_ids
    assert 0 not in tokenizer.encode("hello world")


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.  Two  spaces,\ttabs\nand newlines\n\n",
    "你好，世界！今天我们训练一个小型语言模型。",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\tif x != 0: pass\r\n",
    "emoji 🚀🔥 family 👩\u200d👩\u200d👧 flags 🇨🇳 and ümlauts, ﬁ ligature, \x00 nul",
    " leading and trailing spaces ",
])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert max(ids) < 6400
    assert tokenizer.decode(ids) == text


def test_chat_template_two_turns(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！", "reasoning_content": "A greeting."},
    ]
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n"
                "<|im_start|>user\n你好<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nA greeting.\n</think>\n\n你好！<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected


def test_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, open_thinking=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


TOOLS = [{"type": "function", "function": {"name": "weekday", "description": "Day of the week.", "parameters": {
              "type": "object", "properties": {"date": {"type": "string"}}}}},
         {"name": "gcd", "description": "中文 description", "parameters": {"type": "object"}}]
TEMPLATE_CASES = [  # (messages, tools, extra template arguments)
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], None, {}),
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "\n\nlead", "reasoning_content": "\nwhy\n"}], None, {}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\ninline\n</think>\n\nanswer"}],
     None, {}),
    ([{"role": "user", "content": "day?"},  # tools without a system message, two calls, two results
      {"role": "assistant", "content": "Checking.", "tool_calls": [
          {"type": "function", "function": {"name": "weekday", "arguments": '{"date": "2024-01-01"}'}},
          {"name": "gcd", "arguments": {"a": 4, "b": 6}}]},
      {"role": "tool", "content": "Monday"}, {"role": "tool", "content": "2"},
      {"role": "assistant", "content": "Monday; 2."}], TOOLS, {}),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
      {"role": "assistant", "content": "", "tool_calls": [{"name": "gcd", "arguments": {"a": 1, "b": 1}}]},
      {"role": "tool", "content": "1"}, {"role": "system", "content": "late system"}], TOOLS, {}),
    ([{"role": "user", "content": "q"}], None, {"add_generation_prompt": True}),
    ([{"role": "user", "content": "q"}], TOOLS, {"add_generation_prompt": True, "open_thinking": True}),
]


@pytest.mark.parametrize("case", range(len(TEMPLATE_CASES)))
def test_chat_template_renders_like_minimind3(tokenizer, case):
    """Our template renders as MiniMind-3's (verbatim in tests/fixtures) does, character for character."""
    messages, tools, extra = TEMPLATE_CASES[case]
    with open(MINIMIND3_CONFIG, encoding="utf-8") as f:
        reference_template = json.load(f)["chat_template"]
    ours = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra)
    theirs = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=reference_template,
                                           **extra)
    assert ours == theirs


def test_committed_config_matches_script(tokenizer):
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f) == tokenizer_config()


def test_training_is_deterministic(tmp_path):
    """Two fresh processes (different hash seeds) train byte-identical tokenizers with all 36 added tokens
    at MiniMind-3's ids, on a corpus that holds tool rows as JSON strings and as lists."""
    pretrain, sft = tmp_path / "p.jsonl", tmp_path / "s.jsonl"
    pretrain.write_text("".join(json.dumps({"text": f"document {i}: 你好 def f(x): return x ** {i}"}) + "\n"
                                for i in range(200)), encoding="utf-8")
    tool_calls = [{"name": "gcd", "arguments": {"a": 12, "b": 18}}]
    sft.write_text("".join(json.dumps({"conversations": [
        {"role": "user", "content": "gcd?"},
        {"role": "assistant", "content": "", "reasoning_content": "use gcd",
         "tool_calls": json.dumps(tool_calls) if i % 2 else tool_calls}]}) + "\n" for i in range(20)), encoding="utf-8")
    code = ("import sys; sys.path.insert(0, %r); from scripts.train_tokenizer import train_tokenizer, iter_texts; "
            "sys.stdout.write(train_tokenizer(iter_texts(sys.argv[1], sys.argv[2]), 600).to_str())" % ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(pretrain), str(sft)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                              env=dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")) for seed in ("1", "2")]
    try:
        results = [proc.communicate(timeout=120) for proc in procs]  # side by side: one core each where there are two
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in results]
    outputs = [out for out, _ in results]
    assert outputs[0] == outputs[1]
    state = json.loads(outputs[0])
    with open(MINIMIND3_CONFIG, encoding="utf-8") as f:
        reference = json.load(f)["added_tokens_decoder"]
    assert [(t["id"], t["content"], t["special"]) for t in state["added_tokens"]] == \
        [(int(i), e["content"], e["special"]) for i, e in reference.items()]


def test_tokenizer_from_a_curated_folder_trains_and_feeds_the_trainer(tmp_path):
    """train_tokenizer --data_path streams a folder of JSONL and parquet shards (as curate_data writes them), keeps
    MiniMind-3's added tokens and chat template, reports bytes per token on every 10th document (held out) for both
    tokenizers as transformers computes them here, and a short pretraining run takes it as --tokenizer_path."""
    with open(os.path.join(ROOT, "dataset", "pretrain_demo.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:1200]
    chinese = "段：今天我们在图书馆学习语言模型的训练方法，然后写下自己的笔记。"
    texts[::7] = [f"第{i}{chinese}" for i in range(len(texts[::7]))]
    corpus = tmp_path / "curated"
    corpus.mkdir()
    for name, part in (("00000.jsonl", texts[:500]), ("00001.jsonl", texts[500:900])):
        (corpus / name).write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in part),
                                   encoding="utf-8")
    pd.DataFrame({"text": texts[900:]}).to_parquet(corpus / "00002.parquet")
    out = tmp_path / "tok"
    proc = forked("scripts/train_tokenizer.py", ["--data_path", corpus, "--vocab_size", 1000, "--out_dir", out,
                                                 "--heldout_every", 10], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, minimind = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(MODEL_DIR)
    assert len(ours) == 1000
    with open(out / "tokenizer_config.json", encoding="utf-8") as f:
        assert json.load(f) == tokenizer_config()  # the same added tokens, ids and chat template as MiniMind-3's
    assert ours.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]) == [0, 1, 2, 25]
    held_out = texts[9::10]  # files in name order, every 10th document
    report = json.loads((out / "tokenizer_report.json").read_text())
    for tok, key in ((ours, "bytes_per_token"), (minimind, "minimind_bytes_per_token")):
        tokens = sum(len(tok(t, add_special_tokens=False).input_ids) for t in held_out)
        assert report[key] == pytest.approx(sum(len(t.encode("utf-8")) for t in held_out) / tokens, rel=1e-12)
    assert report["heldout_docs"] == len(held_out) and all(ours.decode(ours.encode(t)) == t for t in held_out)
    run = forked("trainer/train_pretrain.py", [*TINY_MODEL, "--data_path", corpus, "--tokenizer_path", out,
                                               "--max_steps", 2, "--max_seq_len", 64, "--batch_size", 4,
                                               "--save_dir", tmp_path / "o", "--checkpoint_dir", tmp_path / "c"],
                 timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"tokenizer {out}" in run.stdout + run.stderr
    # the model's rows follow the tokenizer: its 1,000 ids rounded up to a multiple of 64 (MiniMind's 6,400 before)
    assert json.loads((tmp_path / "o" / "pretrain_64.json").read_text())["vocab_size"] == 1024
    assert "(vocab 1,024), initialised from --seed" in run.stdout


def test_a_comparison_on_few_held_out_documents_says_so(tmp_path, capsys):
    """60 documents, every 10th held out: the bytes-per-token comparison rests on 6 and the output says so."""
    from scripts.train_tokenizer import main as train_main
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: the quick brown fox {i * 7}"}) + "\n"
                              for i in range(60)))
    train_main(["--data_path", str(corpus), "--vocab_size", "400", "--out_dir", str(tmp_path / "tok"),
                "--heldout_every", "10"])
    out = capsys.readouterr().out
    assert "held-out 6 documents" in out
    assert ("note: 6 held-out documents are too few for the comparison to say much (under 100); a smaller "
            "--heldout_every holds out more of a small corpus") in out
