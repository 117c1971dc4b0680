"""
Train MiniMind's tokenizer: byte-level BPE, vocab 6400, MiniMind-3's added tokens and chat template.

    python scripts/train_tokenizer.py            # demo corpora -> model/tokenizer.json, tokenizer_config.json

Byte-level means every string (Chinese, emoji, code) encodes losslessly: decode(encode(x)) == x.
Training is deterministic, so re-running it reproduces the committed files byte for byte.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.runtime.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "tokenizers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

# MiniMind-3's added tokens, same ids and order: 0 pad/unk, 1 bos, 2 eos, 3-20 reserved multimodal markers
# (special), 21-26 tool-call and reasoning tags, 27-35 buffers (not special: decode keeps them, so tool calls
# and reasoning survive skip_special_tokens and can be parsed from the generated text)
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
TAG_TOKENS += [f"<|buffer{i}|>" for i in range(1, 10)]
ADDED_TOKENS = SPECIAL_TOKENS + TAG_TOKENS

# Renders like MiniMind-3's template (its text, token for token), written out plainly:
# - tools: one system block with the schema (the system message's content first, if any);
# - assistant: "<think>\n{reasoning}\n</think>\n\n{content}" then each tool call as <tool_call> JSON;
#   reasoning comes from reasoning_content, or from a "<think>...</think>" prefix of the content;
# - tool results: consecutive tool messages share one user turn, each wrapped in <tool_response>;
# - generation prompt: an empty think block, or an open "<think>\n" with open_thinking=True.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if message.reasoning_content is not string and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set function = call.function or call %}
            {{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' }}
            {{- function.arguments if function.arguments is string else function.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {{- '<think>\n' if open_thinking is defined and open_thinking is true else '<think>\n\n</think>\n\n' }}
{%- endif %}
""".strip()


def iter_texts(pretrain_path, sft_path):
    """Pretraining texts, then every SFT message's text fields (content, reasoning, tools), in file order."""
    with open(pretrain_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]
    with open(sft_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                for message in json.loads(line)["conversations"]:
                    for field in ("content", "reasoning_content", "tools", "tool_calls"):
                        value = message.get(field)
                        if value:  # tools / tool_calls may be JSON strings or lists (MiniMind-3 stores strings)
                            yield value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def train_tokenizer(texts, vocab_size=6400):
    """Byte-level BPE trained on `texts`; the added tokens come first, with MiniMind-3's ids 0-35."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    # the trainer marks all its tokens special; the tags and buffers are not (as in MiniMind-3)
    state = json.loads(tokenizer.to_str())
    for entry in state["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    tokenizer = Tokenizer.from_str(json.dumps(state))
    for token_id, token in enumerate(ADDED_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, f"{token} got id {tokenizer.token_to_id(token)}"
    return tokenizer


def tokenizer_config(model_max_length=32768):
    """tokenizer_config.json contents (MiniMind's fields) for PreTrainedTokenizerFast."""
    added_tokens = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": tok in SPECIAL_TOKENS}
        for i, tok in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": SPECIAL_TOKENS[1:],  # as MiniMind-3: all special ones but pad
        "bos_token": "<|im_start|>",
        "clean_up_tokenization_spaces": False,  # cleanup would break decode(encode(x)) == x
        "eos_token": "<|im_end|>",
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    parser = argparse.ArgumentParser(description="Train the MiniMind byte-level BPE tokenizer")
    parser.add_argument("--pretrain_path", default=None, help="pretrain JSONL (default: built-in demo corpus)")
    parser.add_argument("--sft_path", default=None, help="SFT JSONL (default: built-in demo corpus)")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "model"))
    args = parser.parse_args()

    pretrain_path = args.pretrain_path or ensure_demo_data("pretrain")
    sft_path = args.sft_path or ensure_demo_data("sft")
    tokenizer = train_tokenizer(iter_texts(pretrain_path, sft_path), args.vocab_size)

    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer.save(os.path.join(args.out_dir, "tokenizer.json"))
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"vocab {tokenizer.get_vocab_size()} -> {args.out_dir}/tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
