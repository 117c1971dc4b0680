"""What weights were made with, by content: the tokenizer a run used (recorded beside every weights file) and
content digests of weight files (a DPO reference, a distillation teacher), so that a later use can tell.

A record names the tokenizer as {"path": folder, "sha256": sha256 of its tokenizer.json}. The hash decides: a
folder with the same tokenizer.json is the same tokenizer wherever it lies, and a folder that changed is not
(model/tokenizer_choice.py picks the tokenizer a run or a script uses from the record and the flags).
"""
import glob
import hashlib
import os
import shutil

BLOCK = 1 << 20  # bytes read at a time while hashing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def content_sha256(path):
    """sha256 of a file's bytes (`sha256sum`'s), or of a folder's files (relative names and bytes, sorted)."""
    digest = hashlib.sha256()
    files = [(None, path)] if os.path.isfile(path) else sorted(
        (os.path.relpath(os.path.join(root, name), path), os.path.join(root, name))
        for root, _, names in os.walk(path) for name in names)
    for name, file in files:
        if name is not None:
            digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(folder):
    """sha256 of `folder`/tokenizer.json (the vocabulary, merges and added tokens); None without one."""
    path = os.path.join(folder, "tokenizer.json")
    return content_sha256(path) if os.path.isfile(path) else None


def tokenizer_record(folder):
    """What a weights file records about the tokenizer its run used."""
    return {"path": os.path.abspath(folder), "sha256": tokenizer_sha256(folder)}


def short(sha):
    return sha[:12] if sha else "none"


def tokenizer_files(folder):
    """The files of a Hugging Face tokenizer folder (chat templates in *.jinja included), by name."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    return names + sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.jinja")))


def copy_tokenizer(src, out_dir):
    """Copy the tokenizer files of `src` into `out_dir`; returns their names."""
    names = tokenizer_files(src)
    for name in names:
        shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    return names
