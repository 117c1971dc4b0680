"""A generation prompt's tokens agree with what SFT trained on (dataset/chat.py cuts a row where a turn's generation
prompt ends; dataset/prompt_ids.py tokenizes a prompt as every stock consumer does): the server, the web demo, the
tool-call eval, the samples logged in training, the RL prompts and transformers' own chat template on an exported
folder all start from these ids."""
import pytest

from dataset.chat import SFTDataset
from dataset.prompt_ids import prompt_ids
from tests.helpers.launch import write_rows

CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}],
    [{"role": "user", "content": "gcd?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "gcd", "arguments": {"a": 4, "b": 6}}]}],
    [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"},
     {"role": "user", "content": "再见"}, {"role": "assistant", "content": "再见。"}],
]


def trained(tokenizer, messages, tmp_path):
    """(ids, labels) of `messages` as SFT trains on them: a real SFTDataset on a one-row file."""
    ds = SFTDataset(write_rows(tmp_path / "chat.jsonl", [{"conversations": messages}]), tokenizer, max_length=512,
                    cache_dir=tmp_path / "cache")
    ids, labels = ds._conversation(0)
    return ids.tolist(), labels.tolist()


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_the_stock_prompt_is_a_prefix_of_what_sft_trained_on(tokenizer, chat, tmp_path):
    """transformers' apply_chat_template(add_generation_prompt=True, tokenize=True) for the conversation before its
    first answer gives the first tokens SFT trained on, and the next one is the answer's first, labelled: "</think>"
    then one "\\n\\n" token, where a row tokenized whole had "\\n", "\\n" (and a model trained on that answered a stock
    prompt with "</think>" again)."""
    messages = CHATS[chat]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    thinking = bool(messages[first].get("reasoning_content"))
    stock = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, open_thinking=thinking,
                                          return_dict=True)  # a dict in transformers 4 too (v5's default)
    stock = stock["input_ids"]
    ids, labels = trained(tokenizer, messages, tmp_path)
    assert ids[:len(stock)] == stock
    text = tokenizer.apply_chat_template(messages[:first], tokenize=False, add_generation_prompt=True,
                                         open_thinking=thinking)
    assert prompt_ids(tokenizer, text) == stock
    if not thinking:
        assert stock[-2:] == tokenizer.convert_tokens_to_ids(["</think>", "ĊĊ"])  # "ĊĊ": the byte-level "\n\n"
        reply = messages[first]["content"] or "<tool_call>"
        assert ids[len(stock)] == labels[len(stock)] == tokenizer(reply, add_special_tokens=False)["input_ids"][0]
        whole = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        if messages[first]["content"]:  # what the cut changes: tokenized whole, text after "\n\n" made it two
            assert whole["input_ids"][len(stock) - 1:len(stock) + 1] == tokenizer.convert_tokens_to_ids(["Ċ", "Ċ"])
    else:  # an open think block: "<think>", "\n", then the reasoning, tokenized whole as before
        assert stock[-2:] == tokenizer.convert_tokens_to_ids(["<think>", "Ċ"])


def test_a_later_turn_differs_from_training_only_in_the_history_s_closing_newlines(tokenizer, tmp_path):
    """The residual, stated: a stock prompt for the second turn renders the first answer in its history and reads
    its "</think>\\n\\n" as "\\n", "\\n" (the answer follows), where SFT's row, cut there, has one "\\n\\n"; the turn
    being answered ends as trained."""
    messages = CHATS[3]
    ids, _ = trained(tokenizer, messages, tmp_path)
    stock = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=True, return_dict=True)["input_ids"]
    double, newline = tokenizer.convert_tokens_to_ids(["ĊĊ", "Ċ"])
    closing = ids.index(tokenizer.convert_tokens_to_ids("</think>")) + 1  # the first turn's closing "\n\n"
    assert ids[closing] == double
    expected = ids[:closing] + [newline, newline] + ids[closing + 1:len(stock) - 1]
    assert stock == expected
