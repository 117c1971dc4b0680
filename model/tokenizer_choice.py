"""Which tokenizer to use with recorded weights (model/provenance.py's record) and the tokenizer flags the user typed:
--tokenizer_path must be the recorded tokenizer unless --force_tokenizer 1; without it, the recorded folder, else
the repository's model/ when its tokenizer.json is the recorded one; the check that a tokenizer folder holds one; and
the model's vocab_size for a tokenizer (model_vocab_size: its ids rounded up to a multiple of 64), the one rule."""
import json
import os

from model.errors import ConfigError
from model.provenance import short, tokenizer_sha256


class TokenizerMismatch(ValueError):
    """A tokenizer that is not the one the weights were trained with: the message is one line saying what to pass."""


def tokenizer_for(record, typed, default, what, force=False):
    """(folder, note or None): the tokenizer to use with weights whose record is `record` ({"path", "sha256"} or None).

    typed: the folder the user passed, or None; default: the repository's model/; what: the weights as the user named
    them, for the messages (e.g. "--from_weight out/x.pth"). A typed folder must hold the recorded tokenizer.json
    (force: use it anyway, with a note); without one, the recorded folder, else `default` when its hash matches.
    """
    path, sha = (record or {}).get("path"), (record or {}).get("sha256")
    if typed:
        got = tokenizer_sha256(typed)
        if sha is None or got == sha:
            return typed, None
        if not force:
            raise TokenizerMismatch(
                f"--tokenizer_path {typed} (tokenizer.json sha256 {short(got)}) is not the tokenizer {what} was "
                f"trained with ({path}, sha256 {short(sha)}); leave --tokenizer_path out to use that one, or pass "
                "--force_tokenizer 1 to use this one anyway")
        return typed, (f"--force_tokenizer 1: using {typed}, not the tokenizer {what} was trained with "
                       f"({path}, sha256 {short(sha)})")
    if path is None:
        return default, f"{what} records no tokenizer; using {default} (--tokenizer_path if the run used another)"
    for folder in [path] + ([default] if sha else []):
        if os.path.isdir(folder) and (sha is None or tokenizer_sha256(folder) == sha):
            same = os.path.realpath(folder) == os.path.realpath(default)
            return folder, None if same else f"{what} was trained with the tokenizer {folder}: using it"
    state = "has changed" if os.path.isdir(path) else "is not found here"
    raise TokenizerMismatch(f"{what} was trained with the tokenizer {path} (tokenizer.json sha256 {short(sha)}), which "
                            f"{state}; pass --tokenizer_path with that tokenizer's folder")


def check_tokenizer(path):
    """A Hugging Face tokenizer folder: a directory with tokenizer.json or tokenizer_config.json."""
    if not os.path.isdir(path):
        raise ConfigError(f"--tokenizer_path {path} is not a directory; pass the folder with tokenizer.json "
                          "(default: model/ in the repo)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"--tokenizer_path {path} has no tokenizer.json or tokenizer_config.json; "
                          "pass a Hugging Face tokenizer folder")


VOCAB_MULTIPLE = 64  # rows padded to a multiple of 64 (MiniMind's 6,400 is one): any power-of-two --tp to 64 divides it


def tokenizer_ids(folder):
    """How many token ids the tokenizer in `folder` uses: its largest id + 1 (base vocabulary and added tokens)."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        vocab = (state.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else range(len(vocab))  # Unigram's is a list
        return 1 + max([*ids, *(token["id"] for token in state.get("added_tokens") or [])], default=-1)
    from transformers import AutoTokenizer  # a folder without tokenizer.json (vocab.json + merges.txt): rare
    return len(AutoTokenizer.from_pretrained(folder))


def model_vocab_size(folder):
    """The model's vocab_size for the tokenizer in `folder`: its ids rounded up to a multiple of VOCAB_MULTIPLE, so the
    model's embedding follows the tokenizer it is trained with (model/tokenizer.json: 6,400, MiniMind's own)."""
    return -(-tokenizer_ids(folder) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def vocab_refusal(folder, rows, what):
    """The line refusing the tokenizer in `folder` for weights of `rows` embedding rows (`what`: the weights as the
    user named them) when its ids reach past them (its tokens would index rows that do not exist); else None."""
    ids = tokenizer_ids(folder)
    if ids <= rows:
        return None
    return (f"--tokenizer_path {folder} has {ids} token ids but {what} has {rows} embedding rows: pass the tokenizer "
            "those weights were trained with, or pretrain with this one (the model's vocab_size follows its tokenizer)")
