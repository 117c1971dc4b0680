"""
PretrainDataset (MiniMind's), backed by an on-disk token cache; SFTDataset is in dataset/chat.py, DPODataset in
dataset/preference_data.py (a pretraining run reads neither).

Each file is tokenized once per node (dataset/tokenizing/token_cache.py: the local ranks split it, each with `num_proc`
worker processes), in chunks through the fast tokenizer's batch API, into flat numpy arrays under dataset/.cache/ that
are read back with numpy.memmap (dataset/shards.py, which also opens scripts/pretokenize.py's shards): the corpus never
lives in memory as Python strings. The cache key covers the file (path, size, mtime), the tokenizer and the format
version.

PretrainDataset and SFTDataset return `(input_ids, labels)` LongTensors of length max_length, labels aligned with
input_ids (the trainer shifts them) and -100 where there is no loss; packed rows with doc_mask add per-document
position ids as a third tensor (row_positions below). DPODataset returns a (chosen, rejected) pair of them, plus the
reference model's log-probs once set. SFT and DPO rows are chat conversations: what they label, and how the chat
template's rendering is labelled, is in dataset/chat.py.
"""

import numpy as np
import torch

from dataset.shards import CHUNK_DOCS, TokenCacheDataset


def _check_text(value):
    return None if isinstance(value, str) else f"'text' must be a string, got {type(value).__name__}"


def row_positions(offsets, start, max_length):
    """Position ids of the packed row of `max_length` tokens starting at token `start` of a stream whose documents
    start at `offsets`: 0 at the row start and at each document start."""
    inside = offsets[np.searchsorted(offsets, start, side="right"):
                     np.searchsorted(offsets, start + max_length, side="left")]
    starts = np.concatenate([[0], inside - start])  # the documents' first tokens, within the row
    index = np.arange(max_length)
    return torch.from_numpy(index - starts[np.searchsorted(starts, index, side="right") - 1])


# ----------------------------------------------------------------------------- the datasets

class PretrainDataset(TokenCacheDataset):
    """Plain text ({"text": ...} JSONL or parquet): each sample is bos + text + eos.

    packing=False: one document per sample, truncated (eos kept) and padded to max_length.
    packing=True: all documents concatenated and cut into full rows of max_length (remainder dropped).
    doc_mask=True (with packing): samples are (input_ids, labels, position_ids), the position ids restarting
    at 0 where a document starts (and at the row's start), so the model attends within documents only.
    data_path may also be a pretokenized `<prefix>.bin` shard from scripts/pretokenize.py.
    num_proc, part=(local_rank, local_world_size): how the cache is built (dataset/tokenizing/token_cache.py).
    """

    kind, field = "pretrain", "text"

    def __init__(self, data_path, tokenizer, max_length=512, packing=False, skip_bad_lines=False, cache_dir=None,
                 num_proc=None, part=(0, 1), doc_mask=False):
        super().__init__(data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part)
        self.packing, self.doc_mask = packing, bool(doc_mask and packing)
        self.num_rows = int(self.offsets[-1]) // max_length if packing else len(self.offsets) - 1
        if self.num_rows == 0:
            raise ValueError(f"{data_path}: {int(self.offsets[-1])} tokens, fewer than max_length={max_length}: "
                             "nothing to pack")

    def _tokenized_chunks(self, records, bad_lines):
        bos, eos = [self.tokenizer.bos_token_id], [self.tokenizer.eos_token_id]
        texts = []
        for lineno, value, error in records:
            error = error or _check_text(value)
            if error:
                bad_lines(lineno, error)
                continue
            texts.append(value)
            if len(texts) == CHUNK_DOCS:
                yield [(bos + ids + eos, None) for ids in self._encode(texts)]
                texts = []
        if texts:
            yield [(bos + ids + eos, None) for ids in self._encode(texts)]

    def _encode(self, texts):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast") and backend.truncation is None \
                and backend.padding is None:  # the same ids without offsets: ~20% less work than __call__
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        tokens, _ = self._arrays()
        if self.packing:
            start = index * self.max_length
            row = tokens[start:start + self.max_length]
            if self.doc_mask:
                return (*self._padded(row, row), row_positions(self.offsets, start, self.max_length))
            return self._padded(row, row)
        doc = tokens[self.offsets[index]:self.offsets[index + 1]]  # bos + text + eos
        if len(doc) > self.max_length:
            doc = np.concatenate([doc[:self.max_length - 1], doc[-1:]])  # = bos + text[:L-2] + eos
        return self._padded(doc, doc)
