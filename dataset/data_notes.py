"""One line each about what a chat, preference or prompt dataset loses or lacks as the trainer reads it: rows without a
target within --max_seq_len, conversations cut at --max_seq_len, preference pairs whose two sides are the same,
prompts whose start is dropped at --max_seq_len, prompts offering tools the mock tools lack (the agent stage)."""
import numpy as np

from dataset.lm_dataset import DPODataset

# the notes of each dataset class, by its name (a pretraining run reads no module of the others): the nearest in the
# class's MRO applies
NOTES = {"DPODataset": lambda ds: [ds.no_target_line(), truncation_line(ds), identical_pairs_line(ds)],
         "SFTDataset": lambda ds: [ds.no_target_line(), truncation_line(ds)],
         "RLAIFDataset": lambda ds: [ds.no_target_line(), ds.unknown_tools_line()]}


def dataset_notes(ds):
    """The info lines about `ds` (an SFTDataset, DPODataset or RLAIFDataset; none for others). ValueError when no pair
    teaches."""
    notes = next((NOTES[cls.__name__] for cls in type(ds).__mro__ if cls.__name__ in NOTES), lambda ds: [])
    return [line for line in notes(ds) if line]


def _longer(side, rows, max_length):
    """How many of `rows` of an SFT cache (a DPO side) hold more than max_length tokens."""
    return int((np.diff(side.offsets)[rows] > max_length).sum())


def truncation_line(ds):
    """How many conversations are longer than --max_seq_len: they are cut at its end, and their answers with it."""
    length = ds.max_length
    if isinstance(ds, DPODataset):
        counts = [(field, _longer(side, ds.pairs, length)) for field, side in (("chosen", ds.chosen),
                                                                               ("rejected", ds.rejected))]
        if not any(n for _, n in counts):
            return None
        return (f"{', '.join(f'{n} {field}' for field, n in counts)} of {len(ds)} pairs of {ds.data_path} are "
                f"longer than --max_seq_len {length}: cut, their answers lose the end")
    cut = _longer(ds, slice(None), length)
    if not cut:
        return None
    return (f"{cut} of {ds.num_conversations} conversations of {ds.data_path} are longer than --max_seq_len "
            f"{length}: cut, their answers lose the end")


def identical_pairs(ds):
    """Indices (into ds) of the pairs whose chosen and rejected rows are the same as trained: the same tokens and
    labels within max_length. Their margin is 0 whatever the model, so their gradient is 0: they teach nothing."""
    length, same = ds.max_length, []
    sides = [(side, *side._arrays()) for side in (ds.chosen, ds.rejected)]
    spans = [np.stack([side.offsets[ds.pairs], np.minimum(side.offsets[ds.pairs + 1], side.offsets[ds.pairs] + length)])
             for side, _, _ in sides]
    candidates = np.flatnonzero(spans[0][1] - spans[0][0] == spans[1][1] - spans[1][0])  # equal lengths first
    for i in candidates:
        (a, b), (c, d) = spans[0][:, i], spans[1][:, i]
        (_, tokens0, mask0), (_, tokens1, mask1) = sides
        if np.array_equal(tokens0[a:b], tokens1[c:d]) and np.array_equal(mask0[a:b], mask1[c:d]):
            same.append(int(i))
    return same


def identical_pairs_line(ds):
    """The line counting pairs with chosen == rejected; ValueError when every pair is one."""
    count = len(identical_pairs(ds))
    if not count:
        return None
    line = (f"{count} of {len(ds)} pairs of {ds.data_path} have chosen == rejected (within --max_seq_len "
            f"{ds.max_length}): they teach nothing")
    if count == len(ds):
        raise ValueError(f"{line}; give each pair a rejected answer that differs from the chosen one")
    return line
