"""One line each about what a chat, preference or prompt dataset loses or lacks as the trainer reads it: rows without a
target within --max_seq_len, conversations cut at --max_seq_len, preference pairs whose two sides are the same,
prompts whose start is dropped at --max_seq_len, prompts offering tools the mock tools lack (the agent stage)."""
import numpy as np

# the notes of each dataset class, by its name (a pretraining run reads no module of the others): the nearest in the
# class's MRO applies
NOTES = {"DPODataset": lambda ds: [ds.no_target_line(), truncation_line(ds), identical_pairs_line(ds)],
         "SFTDataset": lambda ds: [ds.no_target_line(), truncation_line(ds)],
         "RLAIFDataset": lambda ds: [ds.no_target_line(), ds.unknown_tools_line()],
         "RewardPairs": lambda ds: dataset_notes(ds.pairs)}  # the reward model's pairs: DPO's, with a margin


def dataset_notes(ds):
    """The info lines about `ds` (an SFTDataset, DPODataset, RewardPairs or RLAIFDataset; none for others). ValueError
    when no pair teaches."""
    notes = next((NOTES[cls.__name__] for cls in type(ds).__mro__ if cls.__name__ in NOTES), lambda ds: [])
    return [line for line in notes(ds) if line]


def _longer(side, rows, max_length):
    """How many of `rows` of an SFT cache (a DPO side) hold more than max_length tokens."""
    return int((np.diff(side.offsets)[rows] > max_length).sum())


def truncation_line(ds):
    """How many conversations are longer than --max_seq_len: they are cut at its end, and their answers with it."""
    length = ds.max_length
    if hasattr(ds, "chosen"):  # a DPODataset (dataset/preference_data.py): its two sides
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


def identical_pairs_line(ds):
    """The line counting the pairs with chosen == rejected that DPODataset left out."""
    count = len(ds.identical_rows)
    if not count:
        return None
    return (f"{count} of {len(ds) + count} pairs of {ds.data_path} have chosen == rejected (within --max_seq_len "
            f"{ds.max_length}): they teach nothing and are left out")
