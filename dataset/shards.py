"""The token arrays a dataset reads: a token cache directory (built once per node by dataset/tokenizing/token_cache.py,
keyed by the file, the tokenizer and the format version) or a pretokenized shard (scripts/pretokenize.py),
memory-mapped.

TokenCacheDataset is the datasets' common part (dataset/lm_dataset.py, chat.py, preference_data.py): it checks the
arguments, builds or reuses the cache (or opens the shard) and maps its arrays lazily in each process: tokens
uint16/uint32, int64 document offsets, uint8 loss mask (SFT only). The corpus never lives in memory as Python strings.
"""
import hashlib
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.cache_guard import CACHE_FORMAT_VERSION, discard_if_damaged, format_version, read_token_cache

DATASET_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE_DIR = os.path.join(DATASET_DIR, ".cache")


def tokenizer_fingerprint(tokenizer):
    """Hash of everything about the tokenizer that changes the cached ids and masks."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, len(tokenizer), vocab, tokenizer.bos_token_id,
             tokenizer.eos_token_id, tokenizer.eos_token, getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def local_part():
    """(local_rank, local_world_size) of this process under torchrun; (0, 1) otherwise: the part of a token cache it
    builds."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def cache_dir_for(kind, data_path, tokenizer, skip_bad_lines, cache_dir):
    stat = os.stat(data_path)
    key = [format_version(kind), kind, os.path.abspath(data_path), stat.st_size, stat.st_mtime_ns,
           tokenizer_fingerprint(tokenizer), bool(skip_bad_lines)]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{os.path.basename(data_path)}.{kind}.{digest}")


def _build_cache(dataset, skip_bad_lines, num_proc, part):
    """Tokenize dataset.data_path into dataset.cache_path, once per node (see dataset/tokenizing/token_cache.py)."""
    # the build path (worker processes, locks, a part per local rank): read on a cache miss only
    from dataset.tokenizing.token_cache import build_token_cache
    build_token_cache(dataset.cache_path, dataset.data_path, dataset.field, dataset._tokenized_chunks,
                      dataset.token_dtype, skip_bad_lines, num_proc=num_proc, part=part,
                      format_version=format_version(dataset.kind))


# scripts/pretokenize.py writes <prefix>.bin (tokens), <prefix>.idx (int64 document offsets),
# <prefix>.mask (uint8 loss mask, SFT only) and <prefix>.json (meta): the token cache's arrays, renamed.
SHARD_SUFFIX = ".bin"
CHUNK_DOCS = 1024  # documents per tokenizer batch call: big enough for speed, small enough for memory


def shard_files(prefix):
    """Paths of a pretokenized shard's files, keyed as in the token cache."""
    return {"tokens": prefix + ".bin", "offsets": prefix + ".idx", "mask": prefix + ".mask", "meta": prefix + ".json"}


def open_shard(token_path, kind, tokenizer):
    """(meta, files) of a pretokenized shard; refuses a shard of another kind or tokenizer."""
    files = shard_files(token_path[:-len(SHARD_SUFFIX)])
    for name in ("offsets", "meta"):
        if not os.path.isfile(files[name]):
            raise FileNotFoundError(f"{token_path}: pretokenized shard without {files[name]}; "
                                    "rebuild it with scripts/pretokenize.py")
    with open(files["meta"]) as f:
        meta = json.load(f)
    if meta.get("kind") != kind:
        raise ValueError(f"{token_path} holds {meta.get('kind')} data, not {kind}")
    if meta.get("format_version", CACHE_FORMAT_VERSION) != format_version(kind):
        raise ValueError(f"{token_path} holds {kind} tokens of format {meta.get('format_version')}, this version "
                         f"reads {format_version(kind)}; rebuild it with scripts/pretokenize.py")
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{token_path} was tokenized with another tokenizer; rebuild it with scripts/pretokenize.py")
    return meta, files


class TokenCacheDataset(Dataset):
    """Common part: validate arguments, build or reuse the cache, memmap it lazily."""

    kind = field = None

    def __init__(self, data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part):
        data_path = os.fspath(data_path)
        if not os.path.isfile(data_path):
            raise FileNotFoundError(f"data file not found: {data_path}")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name) is None:
                raise ValueError(f"tokenizer has no {name}; set it in tokenizer_config.json")
        self.data_path, self.tokenizer, self.max_length = data_path, tokenizer, max_length
        self.pad_token_id = tokenizer.pad_token_id
        self.token_dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32
        if data_path.endswith(SHARD_SUFFIX):  # pretokenized by scripts/pretokenize.py: no cache to build
            self.cache_path = None
            self.meta, files = open_shard(data_path, self.kind, tokenizer)
        else:
            self.cache_path = cache_dir_for(self.kind, data_path, tokenizer, skip_bad_lines,
                                             cache_dir or DEFAULT_CACHE_DIR)
            if not discard_if_damaged(self.cache_path, quiet=part[0] != 0):  # absent, or damaged: built (again)
                _build_cache(self, skip_bad_lines, num_proc, part)
            self.meta, files = read_token_cache(self.cache_path)
        self._token_file, self._mask_file = files["tokens"], files["mask"]
        self.num_bad_lines = self.meta["num_bad_lines"]
        self.offsets = np.fromfile(files["offsets"], dtype=np.int64)
        self._tokens = self._mask = None

    def _tokenized_chunks(self, records, bad_lines):
        """Chunks (lists) of (ids, mask or None) from (lineno, value, error) records; runs in worker processes."""
        raise NotImplementedError

    def _arrays(self):
        """Open the memmaps on first use in each process (DataLoader workers included)."""
        if self._tokens is None:
            self._tokens = np.memmap(self._token_file, dtype=self.meta["token_dtype"], mode="r")
            if os.path.exists(self._mask_file):
                self._mask = np.memmap(self._mask_file, dtype=np.uint8, mode="r")
        return self._tokens, self._mask

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tokens"] = state["_mask"] = None  # pickling a memmap would copy the whole corpus
        return state

    def _padded(self, ids, labels):
        """Pad to max_length: pad_token_id in input_ids, -100 in labels."""
        input_ids = torch.full((self.max_length,), self.pad_token_id, dtype=torch.long)
        target = torch.full((self.max_length,), -100, dtype=torch.long)
        input_ids[:len(ids)] = torch.from_numpy(ids.astype(np.int64))
        target[:len(labels)] = torch.from_numpy(labels.astype(np.int64))
        return input_ids, target
