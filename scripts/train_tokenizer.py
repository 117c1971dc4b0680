"""
Train MiniMind's tokenizer: byte-level BPE, vocab 6400, ChatML special tokens.

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

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from dataset.demo_data import ensure_demo_data  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (pad/unk), 1 (bos), 2 (eos)
# MiniMind's ChatML: one "<|im_start|>{role}\n{content}<|im_end|>\n" block per message
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def iter_texts(pretrain_path, sft_path):
    """Pretraining texts, then every SFT message content, in file order."""
    with open(pretrain_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]
    with open(sft_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                for message in json.loads(line)["conversations"]:
                    yield message["content"]


def train_tokenizer(texts, vocab_size=6400):
    """Byte-level BPE trained on `texts`, special tokens first so they get ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, f"{token} got id {tokenizer.token_to_id(token)}"
    return tokenizer


def tokenizer_config(model_max_length=32768):
    """tokenizer_config.json contents (MiniMind's fields) for PreTrainedTokenizerFast."""
    added_tokens = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": [],
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
