"""A generation prompt is tokenized as training saw the same text with the reply after it (dataset/chat.py
prompt_ids): the server, the web demo, the tool-call eval, the samples logged in training and the RL prompts all
start from these ids."""
import pytest

from dataset.prompt_ids import prompt_ids

CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}],
    [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"},
     {"role": "user", "content": "再见"}, {"role": "assistant", "content": "再见。"}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_prompt_is_a_prefix_of_what_sft_trained_on(tokenizer, messages):
    thinking = bool(messages[-1].get("reasoning_content"))
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True,
                                           open_thinking=thinking)
    assert full.startswith(prompt)
    trained = tokenizer(full, add_special_tokens=False)["input_ids"]
    ids = prompt_ids(tokenizer, prompt)
    assert ids == trained[:len(ids)]
    assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == prompt
    newline = tokenizer.convert_tokens_to_ids("Ċ")  # the byte-level "\n"
    if not thinking:  # the closed empty think block ends "</think>", "\n", "\n" (not one "\n\n" token)
        assert ids[-3:] == [tokenizer.convert_tokens_to_ids("</think>"), newline, newline]
        assert tokenizer(prompt, add_special_tokens=False)["input_ids"][-1] != newline  # what it fixes


def test_a_trailing_space_keeps_the_plain_tokenization(tokenizer):
    # " A" would be one token: no split of the prompt alone matches it, so the prompt's own tokens are kept
    assert prompt_ids(tokenizer, "Say hi ") == tokenizer("Say hi ", add_special_tokens=False)["input_ids"]
    assert prompt_ids(tokenizer, "Say hi") == tokenizer("Say hi", add_special_tokens=False)["input_ids"]
