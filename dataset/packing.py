"""SFT's packing (--packing 1): whole conversations placed into rows of max_length tokens, best-fit decreasing.

pack_conversations is read by SFTDataset (dataset/chat.py) only; pretraining's rows are cut from the concatenated
stream, and their per-document positions (row_positions) live with PretrainDataset in dataset/lm_dataset.py.
"""
import bisect

import numpy as np


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
