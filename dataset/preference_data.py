"""Preference data: DPO's pairs (DPODataset, each side an SFT conversation), the reward model's pairs with an optional
margin (RewardPairs) and KTO's unpaired rows with a desirable flag (KTODataset).

- RewardPairs: MiniMind's dpo.jsonl ({"chosen", "rejected"}), each pair with TRL's optional "margin" column
  (a number per row; 0 where the file has none): the reward model's loss is -logsigmoid(r_chosen - r_rejected - margin).
- KTODataset: {"conversations": [messages ending with the assistant's answer], "label": true | false} (TRL's
  unpaired preference format, in SFT's conversation rows). An item is the row and its KL row: the row's prompt
  with the completion of another row (the next usable row in the file), which KTO's KL baseline is estimated on.
"""
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.chat import SFTDataset, longer_rows
from dataset.shards import CHUNK_DOCS, SHARD_SUFFIX
from dataset.tokenizing.file_ranges import extent, is_parquet, iter_records


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
        self.data_path, self.max_length, self.pad_token_id = data_path, max_length, self.chosen.pad_token_id
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

    def notes(self):
        """The info lines about what the pairs lose at max_length, and the identical pairs left out."""
        return [line for line in (self.no_target_line(), self.truncation_line(), self.identical_pairs_line()) if line]

    def truncation_line(self):
        """How many sides are longer than --max_seq_len: they are cut at its end, and their answers with it."""
        sides = (("chosen", self.chosen), ("rejected", self.rejected))
        counts = [(field, longer_rows(side, self.pairs, self.max_length)) for field, side in sides]
        if not any(n for _, n in counts):
            return None
        return (f"{', '.join(f'{n} {field}' for field, n in counts)} of {len(self)} pairs of {self.data_path} are "
                f"longer than --max_seq_len {self.max_length}: cut, their answers lose the end")

    def identical_pairs_line(self):
        """The line counting the pairs with chosen == rejected that were left out."""
        count = len(self.identical_rows)
        if not count:
            return None
        return (f"{count} of {len(self) + count} pairs of {self.data_path} have chosen == rejected (within "
                f"--max_seq_len {self.max_length}): they teach nothing and are left out")

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



def column_values(path, field, number):
    """[(line, value or None, error or None)] of each record's `field` (records in file order, blank lines skipped, as
    the token caches count them; a value must be a number, or true/false where not `number`); None when no record
    has the field at all."""
    if is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        if field not in pq.ParquetFile(path).schema_arrow.names:
            return None
    records = list(iter_records(path, field, *extent(path)))
    if all(error for _, _, error in records):
        return None
    out = []
    for lineno, value, error in records:
        fits = isinstance(value, (int, float)) if number else True
        if error is None and (isinstance(value, bool) is number or not fits):
            error = f"'{field}' must be {'a number' if number else 'true or false'}, got {json.dumps(value)}"
        out.append((lineno, None if error else value, error))
    return out


def first_error(path, values):
    """ValueError `path:line: error` of the first bad value."""
    for lineno, _, error in values:
        if error:
            raise ValueError(f"{path}:{lineno}: {error}")


class RewardPairs(Dataset):
    """DPO's pairs (DPODataset) with each pair's margin: items (input_ids (2, L), labels (2, L), margin ())."""

    def __init__(self, data_path, tokenizer, **kwargs):
        self.pairs = DPODataset(data_path, tokenizer, **kwargs)
        margins = column_values(self.pairs.data_path, "margin", number=True)
        rows = np.zeros(len(self.pairs.chosen), dtype=np.float32)
        if margins is not None:  # TRL's optional column: where a file has it, every pair has it
            checked = np.union1d(self.pairs.pairs, self.pairs.identical_rows)  # a left-out pair's margin too
            first_error(self.pairs.data_path, [margins[i] for i in checked])
            rows = np.asarray([0.0 if v is None else v for _, v, _ in margins], dtype=np.float32)
        self.margins = torch.from_numpy(rows[self.pairs.pairs])
        self.data_path, self.num_bad_lines = self.pairs.data_path, self.pairs.num_bad_lines
        self.pad_token_id = self.pairs.pad_token_id

    def no_target_line(self):
        return self.pairs.no_target_line()

    def notes(self):
        """DPO's notes of the pairs (the margin changes none of them)."""
        return self.pairs.notes()

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        input_ids, labels = self.pairs[index][:2]
        return input_ids, labels, self.margins[index]


class KTODataset(Dataset):
    """Unpaired rows with a desirable flag: items (input_ids (2, L), labels (2, L), desirable ()) and, once
    set_reference() gave them, the reference's summed log-probs (2,) of the row and its KL row."""

    def __init__(self, data_path, tokenizer, max_length=1024, skip_bad_lines=False, cache_dir=None, num_proc=None,
                 part=(0, 1)):
        # SFT's rendering, a bad row kept as an empty one: the rows stay aligned with the file's labels
        self.rows = _PreferenceSide("conversations", data_path, tokenizer, max_length=max_length,
                                    skip_bad_lines=skip_bad_lines, cache_dir=cache_dir, num_proc=num_proc, part=part)
        self.data_path, self.max_length, self.pad_token_id = str(data_path), max_length, self.rows.pad_token_id
        labels = column_values(self.data_path, "label", number=False) or []
        if not labels:
            raise ValueError(f"{self.data_path}: no row has a \"label\" (KTO's desirable flag: true or false)")
        if len(labels) != len(self.rows):
            raise ValueError(f"{self.data_path}: {len(labels)} labels for {len(self.rows)} rows; delete its token "
                             "cache")
        if not skip_bad_lines:
            first_error(self.data_path, labels)
        flags = np.asarray([bool(v) for _, v, _ in labels])
        usable = (self.rows.row_lengths() > 0) & np.asarray([error is None for _, _, error in labels])
        self.index = np.flatnonzero(usable)
        self.desirable = torch.from_numpy(flags[self.index].astype(np.float32))
        self.num_bad_lines = len(labels) - len(self.index)
        if len(self.index) < 2:
            raise ValueError(f"{self.data_path}: KTO needs at least 2 usable rows (a row's KL row is another's answer)")
        _check_both_labels(self.data_path, self.desirable)
        self.reference = None

    def cache_key(self):
        """What the rows' tokens depend on (the reference cache's key): the token cache, the row length, the KL rows."""
        return [self.rows.cache_path, self.max_length, "kl: next row"]

    def set_reference(self, log_probs):
        """The reference model's summed log-probs of every row and its KL row, shape (len(self), 2)."""
        self.reference = reference_log_probs(log_probs, len(self))

    def no_target_line(self):
        return None

    def __len__(self):
        return len(self.index)

    def kl_row(self, index):
        """Row `index`'s prompt (its tokens before the first labelled one) + the next row's answer (its tokens from
        its first labelled one on), cut at max_length."""
        ids, labels = self.rows._conversation(int(self.index[index]))
        other_ids, other_labels = self.rows._conversation(int(self.index[(index + 1) % len(self)]))
        prompt, answer = _first_label(labels), _first_label(other_labels)
        return self.rows._padded(np.concatenate([ids[:prompt], other_ids[answer:]])[:self.max_length],
                                 np.concatenate([np.full(prompt, -100), other_labels[answer:]])[:self.max_length])

    def __getitem__(self, index):
        row = self.rows[int(self.index[index])]
        kl = self.kl_row(index)
        item = (torch.stack([row[0], kl[0]]), torch.stack([row[1], kl[1]]), self.desirable[index])
        return item if self.reference is None else (*item, torch.from_numpy(self.reference[index]))


def _check_both_labels(path, desirable):
    """ValueError when every usable row has the same label: KTO's loss weighs desirable against undesirable rows,
    and with one side only its reward metrics and the weights' balance mean nothing."""
    wanted = int(desirable.sum())
    if wanted in (0, len(desirable)):
        have, lack = ("true", "false") if wanted else ("false", "true")
        raise ValueError(f"{path}: all {len(desirable)} usable rows have \"label\": {have}; KTO needs rows of both "
                         f"labels: add rows with \"label\": {lack}")


def _first_label(labels):
    """The position of the first labelled token (len(labels) where none is)."""
    hits = np.flatnonzero(labels != -100)
    return int(hits[0]) if len(hits) else len(labels)
