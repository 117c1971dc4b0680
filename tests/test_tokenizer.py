"""The committed tokenizer (model/tokenizer.json + tokenizer_config.json) loads and behaves like MiniMind's."""
import os

import pytest
from transformers import AutoTokenizer

from scripts.train_tokenizer import tokenizer_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "model")


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
        {"role": "assistant", "content": "你好！"},
    ]
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n4.<|im_end|>\n"
                "<|im_start|>user\n你好<|im_end|>\n"
                "<|im_start|>assistant\n你好！<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected


def test_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_committed_config_matches_script(tokenizer):
    import json
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f) == tokenizer_config()
