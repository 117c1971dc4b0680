"""Packing: rows of max_length tokens holding several documents, and each document's positions within its row.

pack_conversations places whole SFT conversations into rows (best-fit decreasing); row_positions gives a pretraining
row cut from the concatenated stream the position ids that restart at each document (--doc_mask 1).
"""
import bisect

import numpy as np
import torch


def pack_conversations(lengths, max_length):
    """Best-fit decreasing: place conversations of `lengths` (each <= max_length) into rows of max_length tokens.

    Returns (row_offsets, slots): row r holds conversations slots[row_offsets[r]:row_offsets[r + 1]] (indices
    into `lengths`), in ascending order; rows are ordered by their first conversation. A pure function of the
    lengths, so every rank and every layout packs alike. O(n log max_length).
    """
    free, rows_with, rows = [], {}, []  # sorted distinct free spaces of open rows, space -> rows, row -> slots
    for slot in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        need = int(lengths[slot])
        k = bisect.bisect_left(free, need)
        if k == len(free):  # no open row has room: open one
            row, space = len(rows), max_length
            rows.append([])
        else:
            space = free[k]
            row = rows_with[space].pop()
            if not rows_with[space]:
                del rows_with[space], free[k]
        rows[row].append(slot)
        space -= need
        if space > 0:
            if space not in rows_with:
                bisect.insort(free, space)
                rows_with[space] = []
            rows_with[space].append(row)
    rows = sorted(sorted(row) for row in rows)
    row_offsets = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    return row_offsets, np.array([slot for row in rows for slot in row], dtype=np.int64)


def row_positions(offsets, start, max_length):
    """Position ids of the packed row of `max_length` tokens starting at token `start` of a stream whose documents
    start at `offsets`: 0 at the row start and at each document start."""
    inside = offsets[np.searchsorted(offsets, start, side="right"):
                     np.searchsorted(offsets, start + max_length, side="left")]
    starts = np.concatenate([[0], inside - start])  # the documents' first tokens, within the row
    index = np.arange(max_length)
    return torch.from_numpy(index - starts[np.searchsorted(starts, index, side="right") - 1])
