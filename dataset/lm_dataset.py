"""
PretrainDataset, SFTDataset and DPODataset (MiniMind's), backed by an on-disk token cache.

Each file is tokenized once per node (dataset/token_cache.py: the local ranks split it, each with `num_proc` worker
processes), in chunks through the fast tokenizer's batch API, into flat numpy arrays under dataset/.cache/ that are
read back with numpy.memmap (dataset/shards.py, which also opens scripts/pretokenize.py's shards): the corpus never
lives in memory as Python strings. The cache key covers the file (path, size, mtime), the tokenizer and the format
version.

PretrainDataset and SFTDataset return `(input_ids, labels)` LongTensors of length max_length, labels aligned with
input_ids (the trainer shifts them) and -100 where there is no loss; packed rows with doc_mask add per-document
position ids as a third tensor (dataset/packing.py). DPODataset returns a (chosen, rejected) pair of them, plus the
reference model's log-probs once set. SFT and DPO rows are chat conversations: what they label, and how the chat
template's rendering is labelled, is in dataset/chat.py.
"""
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.chat import assistant_spans, chat_messages, labelled_tokens
from dataset.packing import pack_conversations, row_positions
from dataset.shards import SHARD_SUFFIX, TokenCacheDataset

CHUNK_DOCS = 1024  # documents per tokenizer batch call: big enough for speed, small enough for memory
SCAN_TOKENS = 1 << 26  # mask bytes read per block when counting rows without targets: bounded memory


def _check_text(value):
    return None if isinstance(value, str) else f"'text' must be a string, got {type(value).__name__}"


# ----------------------------------------------------------------------------- the datasets

class PretrainDataset(TokenCacheDataset):
    """Plain text ({"text": ...} JSONL or parquet): each sample is bos + text + eos.

    packing=False: one document per sample, truncated (eos kept) and padded to max_length.
    packing=True: all documents concatenated and cut into full rows of max_length (remainder dropped).
    doc_mask=True (with packing): samples are (input_ids, labels, position_ids), the position ids restarting
    at 0 where a document starts (and at the row's start), so the model attends within documents only.
    data_path may also be a pretokenized `<prefix>.bin` shard from scripts/pretokenize.py.
    num_proc, part=(local_rank, local_world_size): how the cache is built (dataset/token_cache.py).
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


class SFTDataset(TokenCacheDataset):
    """Chat data ({"conversations": [message, ...]} JSONL or parquet) rendered with the chat template.

    Messages are MiniMind-3's: role, content, and optionally reasoning_content, tools (the function
    schemas, on the system message) and tool_calls (on assistant messages), the last two as lists or
    as JSON strings. The schemas go to apply_chat_template(tools=...), so the template renders them.
    Labelling is described in dataset/chat.py.

    packing=False: one conversation per sample, truncated and padded to max_length.
    packing=True: whole conversations (each truncated to max_length, never split across rows) packed into rows
    of max_length by pack_conversations, once, when the dataset is opened; conversations without a target are
    left out. Labels are the same tokens' labels. doc_mask=True (with packing): samples are (input_ids, labels,
    position_ids), positions restarting at 0 at each conversation, so the model attends within conversations.
    """

    kind, field = "sft", "conversations"

    def __init__(self, data_path, tokenizer, max_length=1024, skip_bad_lines=False, cache_dir=None, num_proc=None,
                 part=(0, 1), packing=False, doc_mask=False):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("SFTDataset needs a fast tokenizer (it maps assistant text to tokens by offsets)")
        super().__init__(data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part)
        self.packing, self.doc_mask = bool(packing), bool(doc_mask and packing)
        self.num_conversations = len(self.offsets) - 1
        has_target = self._has_targets()
        self.num_rows_without_targets = int((~has_target).sum())
        if self.num_conversations and self.num_rows_without_targets == self.num_conversations:
            raise ValueError(f"no row of {data_path} has an assistant token within --max_seq_len {max_length}; "
                             "raise --max_seq_len")
        if self.packing:  # conversations without a target add no loss and no gradient: they take no room
            kept = np.flatnonzero(has_target)
            lengths = np.minimum(self.offsets[kept + 1] - self.offsets[kept], max_length)
            self.row_offsets, row_slots = pack_conversations(lengths, max_length)
            self.row_docs = kept[row_slots]

    def no_target_line(self):
        """The one info line about rows that teach nothing at this max_length; None when every row has a target."""
        if not self.num_rows_without_targets:
            return None
        if self.packing:
            return (f"{self.num_rows_without_targets} of {self.num_conversations} conversations of {self.data_path} "
                    f"have no assistant token within --max_seq_len {self.max_length}; they teach nothing and are "
                    "left out of the packed rows")
        return (f"{self.num_rows_without_targets} of {len(self)} rows of {self.data_path} have no assistant token "
                f"within --max_seq_len {self.max_length}; they teach nothing")

    def _has_targets(self):
        """Per conversation: a labelled token at positions 1..max_length-1 (position 0 is never a target)."""
        _, mask = self._arrays()
        starts = self.offsets[:-1] + 1
        ends = np.minimum(self.offsets[1:], self.offsets[:-1] + self.max_length)
        if mask is None:
            return np.zeros(len(starts), dtype=bool)
        has_target, lo = [], 0
        while lo < len(starts):  # blocks of rows spanning at most SCAN_TOKENS tokens (one row at least)
            hi = max(lo + 1, int(np.searchsorted(self.offsets, self.offsets[lo] + SCAN_TOKENS, side="right")) - 1)
            s, e = starts[lo:hi], np.maximum(ends[lo:hi], starts[lo:hi])
            base = int(s[0])
            block = np.append(np.asarray(mask[base:int(e.max())]), np.uint8(0))  # reduceat needs every index < len
            windows = np.stack([s - base, e - base], axis=1).ravel()
            has_target.append((np.maximum.reduceat(block, windows)[0::2] > 0) & (e > s))  # an empty window has none
            lo = hi
        return np.concatenate(has_target) if has_target else np.zeros(0, dtype=bool)

    def _tokenized_chunks(self, records, bad_lines):
        texts, spans = [], []
        for lineno, value, error in records:
            if not error:
                try:
                    messages, tools = chat_messages(value, self.field)
                except ValueError as e:
                    error = str(e)
            if not error:
                try:
                    text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
                    spans.append(assistant_spans(self.tokenizer, messages, tools, text))
                    texts.append(text)
                except Exception as e:  # a template may reject e.g. an unexpected role order
                    error = f"cannot apply the chat template ({e})"
            if error:
                bad_lines(lineno, error)
                continue
            if len(texts) == CHUNK_DOCS:
                yield labelled_tokens(self.tokenizer, texts, spans)
                texts, spans = [], []
        if texts:
            yield labelled_tokens(self.tokenizer, texts, spans)

    def __len__(self):
        return len(self.row_offsets) - 1 if self.packing else self.num_conversations

    def _conversation(self, index):
        """(ids, labels) of conversation `index`, truncated to max_length."""
        tokens, mask = self._arrays()
        a, b = self.offsets[index], min(self.offsets[index + 1], self.offsets[index] + self.max_length)
        ids = np.asarray(tokens[a:b], dtype=np.int64)
        return ids, np.where(mask[a:b] > 0, ids, -100)

    def _packed_row(self, index):
        """Packed row `index`: its conversations back to back, then padding; per-conversation positions."""
        parts = [self._conversation(d) for d in self.row_docs[self.row_offsets[index]:self.row_offsets[index + 1]]]
        for _, labels in parts:
            labels[0] = -100  # the shift would make it the previous conversation's last target
        ids = np.concatenate([p[0] for p in parts])
        input_ids, labels = self._padded(ids, np.concatenate([p[1] for p in parts]))
        if not self.doc_mask:
            return input_ids, labels
        # 0, 1, ... per conversation, and for the padding after them (a document of its own)
        sizes = [len(p[0]) for p in parts] + ([self.max_length - len(ids)] if len(ids) < self.max_length else [])
        return input_ids, labels, torch.from_numpy(np.concatenate([np.arange(n) for n in sizes]))

    def __getitem__(self, index):
        if self.packing:
            return self._packed_row(index)
        ids, labels = self._conversation(index)
        return self._padded(ids, labels)


# ----------------------------------------------------------------------------- preference pairs (DPO)

class _PreferenceSide(SFTDataset):
    """One side ("chosen" or "rejected") of a preference file, rendered and labelled as SFT conversations.

    Every row gives one document: a row that is bad on this side becomes an empty document when bad rows are
    skipped, so the two sides of a file stay aligned row by row.
    """

    def __init__(self, field, data_path, tokenizer, **kwargs):
        self.field, self.kind = field, f"dpo_{field}"
        super().__init__(data_path, tokenizer, **kwargs)

    def _tokenized_chunks(self, records, bad_lines):
        run = []
        for record in records:
            run.append(record)
            if len(run) == CHUNK_DOCS:
                yield self._aligned(run, bad_lines)
                run = []
        if run:
            yield self._aligned(run, bad_lines)

    def _aligned(self, run, bad_lines):
        """SFT's documents of `run`, an empty one in place of each bad row (bad_lines raises unless skipping)."""
        failed = set()

        def report(lineno, error):
            bad_lines(lineno, error)
            failed.add(lineno)
        docs = iter([doc for chunk in SFTDataset._tokenized_chunks(self, iter(run), report) for doc in chunk])
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8))
        return [empty if lineno in failed else next(docs) for lineno, _, _ in run]

    def row_lengths(self):
        return np.diff(self.offsets)


def identical_rows(chosen, rejected, rows, length):
    """The file rows (of `rows`) whose chosen and rejected sides are the same as trained: the same tokens and labels
    within `length` tokens."""
    sides = [side._arrays() for side in (chosen, rejected)]
    spans = [np.stack([side.offsets[rows], np.minimum(side.offsets[rows + 1], side.offsets[rows] + length)])
             for side in (chosen, rejected)]
    same = []
    for i in np.flatnonzero(spans[0][1] - spans[0][0] == spans[1][1] - spans[1][0]):  # equal lengths first
        (a, b), (c, d) = spans[0][:, i], spans[1][:, i]
        (tokens0, mask0), (tokens1, mask1) = sides
        if np.array_equal(tokens0[a:b], tokens1[c:d]) and np.array_equal(mask0[a:b], mask1[c:d]):
            same.append(int(rows[i]))
    return np.asarray(same, dtype=np.int64)


def reference_log_probs(log_probs, rows):
    """A preference dataset's reference log-probs as float32 of shape (rows, 2); any other shape is a ValueError."""
    log_probs = np.asarray(log_probs, dtype=np.float32)
    if log_probs.shape != (rows, 2):
        raise ValueError(f"reference log-probs of shape {log_probs.shape}, expected {(rows, 2)}")
    return log_probs


class DPODataset(Dataset):
    """Preference pairs, MiniMind's dpo.jsonl ({"chosen": [messages], "rejected": [messages]}, JSONL or parquet).

    Each side is rendered and labelled as an SFT conversation (assistant tokens only, tools and reasoning
    included), from a token cache per side. An item is one pair, chosen first: (input_ids (2, L), labels (2, L)),
    plus the reference model's summed log-probs (2,) once set_reference() gave them (trainer/stages/dpo.py), so a
    pair always travels in one sample. Rows bad on either side are skipped with --skip_bad_lines, else reported.
    """

    def __init__(self, data_path, tokenizer, max_length=1024, skip_bad_lines=False, cache_dir=None, num_proc=None,
                 part=(0, 1)):
        data_path = os.fspath(data_path)
        if data_path.endswith(SHARD_SUFFIX):
            raise ValueError(f"{data_path}: DPO reads JSONL or parquet rows with 'chosen' and 'rejected', "
                             "not a pretokenized shard")
        kwargs = dict(max_length=max_length, skip_bad_lines=skip_bad_lines, cache_dir=cache_dir, num_proc=num_proc,
                      part=part)
        self.chosen = _PreferenceSide("chosen", data_path, tokenizer, **kwargs)
        self.rejected = _PreferenceSide("rejected", data_path, tokenizer, **kwargs)
        if len(self.chosen) != len(self.rejected):
            raise ValueError(f"{data_path}: the chosen and rejected caches differ in rows; delete them under "
                             f"{os.path.dirname(self.chosen.cache_path)}")
        self.data_path, self.max_length = data_path, max_length
        pairs = np.flatnonzero((self.chosen.row_lengths() > 0) & (self.rejected.row_lengths() > 0))
        self.num_bad_lines = len(self.chosen) - len(pairs)
        if len(pairs) == 0:
            raise ValueError(f"{data_path}: no pair with both 'chosen' and 'rejected' usable")
        # rows whose two sides train as the same tokens: a margin of 0 whatever the model, so no gradient; left out
        self.identical_rows = identical_rows(self.chosen, self.rejected, pairs, max_length)
        self.pairs = np.setdiff1d(pairs, self.identical_rows)
        if len(self.pairs) == 0:
            raise ValueError(f"{len(pairs)} of {len(pairs)} pairs of {data_path} have chosen == rejected (within "
                             f"--max_seq_len {max_length}): they teach nothing; give each pair a rejected answer "
                             "that differs from the chosen one")
        self.reference = None

    def cache_key(self):
        """What the pairs' tokens depend on: both token caches (file, tokenizer) and the row length."""
        return [self.chosen.cache_path, self.rejected.cache_path, self.max_length]

    def set_reference(self, log_probs):
        """The reference model's summed log-probs of every pair, shape (len(self), 2): chosen, rejected."""
        self.reference = reference_log_probs(log_probs, len(self))

    def no_target_line(self):
        """The one info line about sides without an assistant token within max_length; None when every row has one."""
        counts = [(side.field, side.num_rows_without_targets - (len(side) - int((side.row_lengths() > 0).sum())))
                  for side in (self.chosen, self.rejected)]
        if not any(n for _, n in counts):
            return None
        return (f"{', '.join(f'{n} {field}' for field, n in counts)} of {len(self)} pairs of {self.data_path} have "
                f"no assistant token within --max_seq_len {self.max_length}; their log-prob is 0")

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        row = int(self.pairs[index])
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = self.chosen[row], self.rejected[row]
        pair = torch.stack([chosen_ids, rejected_ids]), torch.stack([chosen_labels, rejected_labels])
        if self.reference is None:
            return pair
        return (*pair, torch.from_numpy(self.reference[index]))
