"""
Train MiniMind's tokenizer: byte-level BPE, vocab 6400, MiniMind-3's added tokens and chat template.

    python scripts/train_tokenizer.py            # demo corpora -> model/tokenizer.json, tokenizer_config.json
    python scripts/train_tokenizer.py --data_path curated --vocab_size 6400 --out_dir out/my_tokenizer

--data_path (files, folders or globs of JSONL/parquet, as the trainer takes them) trains on the user's own corpus,
streamed: rows are read one at a time (parquet by record batch), and the BPE trainer keeps only its count of
distinct pre-tokens, so memory follows the vocabulary of the corpus, not its size. Every --heldout_every-th
document (up to --heldout_docs) is left out and afterwards both tokenizers, the new one and MiniMind's, encode it:
bytes per token (UTF-8 bytes / tokens, higher is better compression) are printed side by side. The result loads
with AutoTokenizer and goes to the trainer as --tokenizer_path OUT_DIR.

Byte-level means every string (Chinese, emoji, code) encodes losslessly: decode(encode(x)) == x.
Training is deterministic, so re-running it reproduces the committed files byte for byte.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "tokenizers")

import pyarrow.parquet as pq  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402
from dataset.mixture import resolve_data_spec  # noqa: E402
from model.atomic import atomic_json, atomic_write_text  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

FEW_HELD_OUT = 100  # held-out documents below which the bytes-per-token comparison gets a caveat

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
    yield from file_texts(pretrain_path, "text")
    yield from file_texts(sft_path, "conversations")


def message_texts(conversation):
    """A conversation's text fields (content, reasoning, tools, tool calls), message by message."""
    for message in conversation:
        for field in ("content", "reasoning_content", "tools", "tool_calls"):
            value = message.get(field)
            if value:  # tools / tool_calls may be JSON strings or lists (MiniMind-3 stores strings)
                yield value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def file_rows(path, field):
    """The `field` value of each row of a JSONL or parquet file, one row at a time."""
    if path.endswith(".parquet"):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256, columns=[field]):
            yield from batch.column(0).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line).get(field)


def file_texts(path, field):
    """Texts of a file: the `field` strings, or with field 'conversations' each message's text fields."""
    for value in file_rows(path, field):
        if field == "conversations":
            yield from message_texts(value or [])
        elif isinstance(value, str) and value:
            yield value


def split_held_out(texts, held_out, every, limit):
    """`texts` without every `every`-th one, which goes to the list `held_out` (at most `limit` of them)."""
    for i, text in enumerate(texts):
        if every and i % every == every - 1 and len(held_out) < limit:
            held_out.append(text)
        else:
            yield text


def bytes_per_token(tokenizer, texts):
    """UTF-8 bytes per token of `texts` under `tokenizer` (a tokenizers.Tokenizer), no special tokens added."""
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return num_bytes / max(num_tokens, 1)


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


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the MiniMind byte-level BPE tokenizer")
    parser.add_argument("--pretrain_path", default=None, help="pretrain JSONL (default: built-in demo corpus)")
    parser.add_argument("--sft_path", default=None, help="SFT JSONL (default: built-in demo corpus)")
    parser.add_argument("--data_path", default=None,
                        help="your corpus: JSONL/parquet files, folders or globs, comma-separated (instead of the two "
                        "above)")
    parser.add_argument("--text_field", default="text", help="with --data_path: the rows' text field, or "
                        "'conversations' for SFT rows")
    parser.add_argument("--heldout_every", type=int, default=100, help="with --data_path: every N-th document is "
                        "held out for the bytes-per-token comparison (0: none)")
    parser.add_argument("--heldout_docs", type=int, default=2000, help="at most this many held-out documents")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "model"))
    args = parser.parse_args(argv)
    if args.vocab_size <= len(ADDED_TOKENS) + 256:
        parser.error(f"--vocab_size must exceed {len(ADDED_TOKENS) + 256} (the added tokens and the 256 bytes)")
    held_out = []
    if args.data_path:
        try:
            files = [f for source, _ in resolve_data_spec(args.data_path) for f in source]
        except (FileNotFoundError, ValueError) as e:
            parser.error(f"--data_path: {e}")
        texts = (t for path in files for t in file_texts(path, args.text_field))
        texts = split_held_out(texts, held_out, args.heldout_every, args.heldout_docs)
    else:  # the committed tokenizer: the demo corpora, nothing held out (its bytes stay reproducible)
        texts = iter_texts(args.pretrain_path or ensure_demo_data("pretrain"), args.sft_path or ensure_demo_data("sft"))
    tokenizer = train_tokenizer(texts, args.vocab_size)

    os.makedirs(args.out_dir, exist_ok=True)
    atomic_write_text(os.path.join(args.out_dir, "tokenizer.json"), tokenizer.to_str(pretty=True))
    atomic_write_text(os.path.join(args.out_dir, "tokenizer_config.json"),
                      json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n")
    print(f"vocab {tokenizer.get_vocab_size()} -> {args.out_dir}/tokenizer.json, tokenizer_config.json")
    if held_out:
        ours = bytes_per_token(tokenizer, held_out)
        minimind = bytes_per_token(Tokenizer.from_file(os.path.join(ROOT, "model", "tokenizer.json")), held_out)
        result = {"heldout_docs": len(held_out), "heldout_bytes": sum(len(t.encode("utf-8")) for t in held_out),
                  "bytes_per_token": ours, "minimind_bytes_per_token": minimind, "vocab_size": args.vocab_size}
        atomic_json(result, os.path.join(args.out_dir, "tokenizer_report.json"))
        print(f"held-out {len(held_out)} documents ({result['heldout_bytes']:,} bytes): bytes per token "
              f"{ours:.3f} (this tokenizer, vocab {tokenizer.get_vocab_size()}) vs {minimind:.3f} (MiniMind's, "
              f"vocab 6400)")
        if len(held_out) < FEW_HELD_OUT:
            print(f"note: {len(held_out)} held-out documents are too few for the comparison to say much (under "
                  f"{FEW_HELD_OUT}); a smaller --heldout_every holds out more of a small corpus")


if __name__ == "__main__":
    main()
