"""Guards around the token cache. Opened, it is checked: a damaged one (cut short, a file lost, overwritten) is
discarded and built again, with a note, instead of feeding training garbage or failing with an error that names no
file. Built on a full disk, it stops with one line naming the cache (disk_full_line) and leaves no partial files.

meta.json holds what the arrays must be: num_docs and num_tokens fix the sizes of offsets.bin ((num_docs + 1) int64),
tokens.bin (num_tokens x token_dtype) and mask.bin (num_tokens bytes, SFT only); caches written since also record
each file's size and the sha256 of offsets.bin (the document boundaries every row is cut by).
"""
import errno
import hashlib
import json
import os
import shutil

import numpy as np

CACHE_FORMAT_VERSION = 2  # 2: SFT labels cover think blocks and tool calls; tools rendered
CHAT_FORMAT_VERSION = 3  # chat rows (every kind but pretrain): 3: a turn's generation prompt tokenized as a prompt


def format_version(kind):
    """The token cache format of a kind of rows: chat rows' tokens changed in version 3 (dataset/chat.py)."""
    return CACHE_FORMAT_VERSION if kind == "pretrain" else CHAT_FORMAT_VERSION
BLOCK = 1 << 20
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, quota, file size limit


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_header(cache_dir):
    """What meta.json records to check the arrays of `cache_dir` by: each file's size, the offsets' sha256."""
    files = {name: os.path.getsize(os.path.join(cache_dir, name)) for name in ("tokens.bin", "offsets.bin", "mask.bin")
             if os.path.isfile(os.path.join(cache_dir, name))}
    return {"files": files, "offsets_sha256": _sha256(os.path.join(cache_dir, "offsets.bin"))}


def cache_problem(cache_dir):
    """None when the complete cache `cache_dir` is whole, else what is wrong with it (a few words)."""
    try:
        with open(os.path.join(cache_dir, "meta.json")) as f:
            meta = json.load(f)
        expected = {"offsets.bin": 8 * (meta["num_docs"] + 1),
                    "tokens.bin": meta["num_tokens"] * np.dtype(meta["token_dtype"]).itemsize}
        if os.path.exists(os.path.join(cache_dir, "mask.bin")) or "mask.bin" in meta.get("files", {}):
            expected["mask.bin"] = meta["num_tokens"]
        for name, size in dict(expected, **meta.get("files", {})).items():
            path = os.path.join(cache_dir, name)
            if not os.path.isfile(path):
                return f"{name} is missing"
            if os.path.getsize(path) != size or expected.get(name, size) != size:
                return f"{name} holds {os.path.getsize(path)} bytes, its header says {size}"
        if "offsets_sha256" in meta and _sha256(os.path.join(cache_dir, "offsets.bin")) != meta["offsets_sha256"]:
            return "offsets.bin does not match its checksum"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json is unreadable ({type(e).__name__})"
    return None


def discard_if_damaged(cache_dir, quiet=False):
    """Check a complete cache; a damaged one is moved aside and removed (the caller builds it again), with a note
    (unless quiet: the other local ranks). Returns whether the cache is there and whole."""
    meta_path = os.path.join(cache_dir, "meta.json")
    try:
        checked = os.stat(meta_path).st_ino
    except FileNotFoundError:
        return False
    problem = cache_problem(cache_dir)
    if problem is None:
        return True
    if not quiet:
        print(f"note: the token cache {cache_dir} is damaged ({problem}); building it again", flush=True)
    aside = f"{cache_dir}.damaged{os.getpid()}"
    try:
        if os.stat(meta_path).st_ino == checked:  # not a cache another rank has built again meanwhile
            os.rename(cache_dir, aside)
    except FileNotFoundError:
        pass  # another rank moved it first
    shutil.rmtree(aside, ignore_errors=True)
    return False


def disk_full_line(error, cache_dir):
    """The one line for a build of `cache_dir` that filled the disk (ENOSPC & co. in `error`'s chain), else None."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return (f"disk full while building the token cache {cache_dir} ({seen.strerror}); free space or choose "
                    "another --cache_dir, then run again")
        seen = seen.__cause__ or seen.__context__
    return None


def read_token_cache(out_dir):
    """(meta, {"tokens", "offsets", "mask": file}) of the complete cache `out_dir` (mask.bin exists for SFT only)."""
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    return meta, {name: os.path.join(out_dir, f"{name}.bin") for name in ("tokens", "offsets", "mask")}


class CacheBuildInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the build (dataset/tokenizing/token_cache.py); `signum` tells which (exit 128 +
    signum)."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum
