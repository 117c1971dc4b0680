"""One line each about what a chat, preference or prompt dataset loses or lacks as the trainer reads it: rows without a
target within --max_seq_len, conversations cut at --max_seq_len, preference pairs whose two sides are the same,
prompts whose start is dropped at --max_seq_len, prompts offering tools the mock tools lack (the agent stage)."""
import numpy as np

from dataset.lm_dataset import DPODataset, SFTDataset
from dataset.preference_data import RewardPairs
from dataset.rlaif_dataset import RLAIFDataset


def dataset_notes(ds):
    """The info lines about `ds` (an SFTDataset, DPODataset, RewardPairs or RLAIFDataset; none for others)."""
    if isinstance(ds, RewardPairs):  # the reward model's pairs: DPO's, with a margin
        ds = ds.pairs
    if isinstance(ds, DPODataset):
        lines = [ds.no_target_line(), truncation_line(ds), identical_pairs_line(ds)]
    elif isinstance(ds, SFTDataset):
        lines = [ds.no_target_line(), truncation_line(ds)]
    elif isinstance(ds, RLAIFDataset):
        lines = [ds.no_target_line(), ds.unknown_tools_line()]
    else:
        lines = []
    return [line for line in lines if line]


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


def identical_pairs_line(ds):
    """The line counting the pairs with chosen == rejected that DPODataset left out."""
    count = len(ds.identical_rows)
    if not count:
        return None
    return (f"{count} of {len(ds) + count} pairs of {ds.data_path} have chosen == rejected (within --max_seq_len "
            f"{ds.max_length}): they teach nothing and are left out")
