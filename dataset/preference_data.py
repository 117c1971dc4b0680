"""Preference data beyond DPO's pairs: the reward model's pairs with an optional margin (RewardPairs) and KTO's
unpaired rows with a desirable flag (KTODataset).

- RewardPairs: MiniMind's dpo.jsonl ({"chosen", "rejected"}), each pair with TRL's optional "margin" column
  (a number per row; 0 where the file has none): the reward model's loss is -logsigmoid(r_chosen - r_rejected - margin).
- KTODataset: {"conversations": [messages ending with the assistant's answer], "label": true | false} (TRL's
  unpaired preference format, in SFT's conversation rows). An item is the row and its KL row: the row's prompt
  with the completion of another row (the next usable row in the file), which KTO's KL baseline is estimated on.
"""
import json

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.file_ranges import extent, is_parquet, iter_records
from dataset.lm_dataset import DPODataset, _PreferenceSide, reference_log_probs


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

    def no_target_line(self):
        return self.pairs.no_target_line()

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
