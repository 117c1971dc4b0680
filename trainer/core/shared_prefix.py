"""Rows whose sequences share a prefix, the prefix run once: DPO's chosen and rejected answers after their prompt, a
GRPO group's completions of one prompt.

A group's first sequence is its row's trunk, whole. Every other sequence follows in the same row from the last token
of the prefix it shares with the first (that token once more, at its own position: the logits there predict the
sequence's own first token), its position ids stepping back to that position, so the model's mask
(model/model_minimind.py packed_document_mask) lets its tokens see the trunk's prefix and themselves: what its own row
would give, up to the order of fp32 sums. The shared prefix ends before the first target of either sequence, so each
target of the row belongs to one sequence; `source` maps them back: per-position values of the shared rows gathered by
`unshare` are the sequences' own, (N, L) as their rows had them.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.core.batches import step_targets


@dataclass
class SharedRows:
    """input_ids, labels, position_ids (R, W): the rows; source (N, L): for sequence n's target at position t, the
    flat index into (R, W) of the shared position whose target it is, -1 where it has none."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor


def used_lengths(input_ids, labels, pad_token_id):
    """(N,) 1 + each row's last position that is not padding or is a target (0 for an empty row)."""
    used = (input_ids != pad_token_id) | (labels != -100)
    positions = torch.arange(1, input_ids.shape[1] + 1)
    return (used * positions).amax(1)


def shared_length(first, other, limit):
    """How many leading tokens two sequences (ids, labels) share, up to `limit` and before either's first target."""
    same = (first[0][:limit] == other[0][:limit]) & (first[1][:limit] == -100) & (other[1][:limit] == -100)
    differ = (~same).nonzero()
    return int(differ[0]) if len(differ) else limit


def share_prefixes(input_ids, labels, group, pad_token_id, multiple=1, capacity=0):
    """SharedRows of N right-padded sequences (N, L) (labels aligned with the ids, as the datasets give them), each
    `group` consecutive ones sharing one prefix; groups packed into rows of up to `capacity` tokens (first fit, in
    order; each group a document of its own, so a row is never longer than its longest group or `capacity`), rows
    right-padded to the longest, rounded up to `multiple`."""
    count = input_ids.shape[0]
    lengths = used_lengths(input_ids, labels, pad_token_id).tolist()
    groups = [group_row(input_ids, labels, lengths, first, group) for first in range(0, count, group)]
    capacity = max(capacity, *(len(ids) for ids, _, _, _ in groups))
    rows = []  # [width used, [(group, its first column)]]
    for g in range(len(groups)):
        size = len(groups[g][0])
        row = next((row for row in rows if row[0] + size <= capacity), None)
        if row is None:
            rows.append(row := [0, []])
        row[1].append((g, row[0]))
        row[0] += size
    width = -(-max(used for used, _ in rows) // multiple) * multiple
    out = SharedRows(torch.full((len(rows), width), pad_token_id, dtype=input_ids.dtype),
                     torch.full((len(rows), width), -100, dtype=labels.dtype),
                     torch.empty((len(rows), width), dtype=torch.long), torch.full_like(input_ids, -1))
    targets = step_targets(labels) != -100
    for r, (used, members) in enumerate(rows):
        for g, column in members:
            ids, labs, positions, columns = groups[g]
            out.input_ids[r, column:column + len(ids)], out.labels[r, column:column + len(ids)] = ids, labs
            out.position_ids[r, column:column + len(ids)] = positions
            sequences = slice(g * group, (g + 1) * group)
            out.source[sequences] = torch.where(targets[sequences] & (columns >= 0), columns + r * width + column, -1)
        last = int(out.position_ids[r, used - 1])  # the padding continues the last segment: seen by none
        out.position_ids[r, used:] = torch.arange(last + 1, last + 1 + width - used)
    return out


def group_row(input_ids, labels, lengths, first, group):
    """One group's (ids, labels, position ids) laid out as one document, and columns (group, L): where each sequence's
    positions landed in it (-1: before its branch)."""
    a = lengths[first]
    ids, labs, positions = [input_ids[first, :a]], [labels[first, :a]], [torch.arange(a)]
    columns = torch.full((group, input_ids.shape[1]), -1, dtype=torch.long)
    columns[0, :a] = torch.arange(a)
    column, previous = a, a - 1
    for n in range(1, group):
        b = lengths[first + n]
        k = shared_length((input_ids[first], labels[first]), (input_ids[first + n], labels[first + n]), min(a, b))
        start = max(min(k - 1, previous), 0)  # a step back (or 0: a document of its own) starts the branch
        ids.append(input_ids[first + n, start:b])
        labs.append(F.pad(labels[first + n, start + 1:b], (1, 0), value=-100))  # no target before its first token
        positions.append(torch.arange(start, b))
        columns[n, start:b] = torch.arange(column, column + b - start)
        column, previous = column + b - start, b - 1
    return torch.cat(ids), torch.cat(labs), torch.cat(positions), columns


def unshare(values, source, width, keep=slice(None)):
    """(N, L) values of the sequences from the values (R, W') of the shared rows' positions `keep` (a slice of their
    `width` or their indices, as target_positions gives them); 0 where a sequence has no target. Differentiable."""
    if isinstance(keep, slice):
        start, stop, _ = keep.indices(width)
        full = F.pad(values, (start, width - stop))
    else:
        full = values.new_zeros(values.shape[0], width).index_copy(1, keep, values)
    picked = full.flatten()[source.clamp(min=0)]
    return torch.where(source >= 0, picked, 0.0)
