"""A weighted mixture of sources as one Dataset (MixtureDataset), loaded by dataset/mixture.py's load_data_spec when
--data_path gives weights ("a.jsonl:0.7,b.jsonl:0.3"). A mixture's epoch holds rows from each source in proportion to
the weights, chosen from (seed, epoch) alone, so data order stays a pure function of (seed, epoch) and resume stays
exact."""
import numpy as np
from torch.utils.data import ConcatDataset, Dataset


def _largest_remainder(total, weights):
    """Integer counts summing to `total`, proportional to `weights` (ties go to the earlier source)."""
    exact = [total * w for w in weights]
    counts = [int(np.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def _row_tokens(dataset, rows):
    """Non-padding input tokens of `rows` of a token-cache dataset (or a ConcatDataset of them); None if unknown."""
    if isinstance(dataset, ConcatDataset):
        ends = dataset.cumulative_sizes
        total = 0
        for k, part in enumerate(dataset.datasets):
            start = ends[k - 1] if k else 0
            own = rows[(rows >= start) & (rows < ends[k])] - start
            tokens = _row_tokens(part, own)
            if tokens is None:
                return None
            total += tokens
        return total
    if getattr(dataset, "packing", False):
        docs = getattr(dataset, "row_docs", None)
        if docs is None:  # packed pretraining: every row is full
            return len(rows) * dataset.max_length
        # packed SFT: a row holds its conversations (each cut to max_length), then padding
        ends = np.cumsum(np.minimum(dataset.offsets[docs + 1] - dataset.offsets[docs], dataset.max_length))
        ends = np.concatenate([[0], ends])
        return int((ends[dataset.row_offsets[rows + 1]] - ends[dataset.row_offsets[rows]]).sum())
    offsets = getattr(dataset, "offsets", None)
    if offsets is None:
        return None
    return int(np.minimum(offsets[rows + 1] - offsets[rows], dataset.max_length).sum())


class MixtureDataset(Dataset):
    """Rows drawn from `sources` (Datasets) in proportion to `weights`, deterministically from (seed, epoch).

    An epoch has num_rows rows (default: all rows of all sources); source i gets its largest-remainder share
    of them: distinct rows in a random order when it has enough, whole passes plus a random remainder when
    it is upsampled. Call set_epoch(epoch) before each epoch, as for DistributedSampler.
    """

    def __init__(self, sources, weights, seed=0, num_rows=None):
        if len(sources) != len(weights) or not sources:
            raise ValueError("MixtureDataset needs one weight per source")
        if any(len(s) == 0 for s in sources) or any(not w > 0 for w in weights):
            raise ValueError("every source needs rows and a positive weight")
        self.sources, self.seed = list(sources), seed
        self.weights = [w / sum(weights) for w in weights]
        self.num_rows = sum(len(s) for s in sources) if num_rows is None else num_rows
        self.counts = _largest_remainder(self.num_rows, self.weights)
        self.set_epoch(0)

    def set_epoch(self, epoch):
        """Choose this epoch's rows: a pure function of (seed, epoch)."""
        self.epoch = epoch
        source_ids, rows = [], []
        for i, (source, count) in enumerate(zip(self.sources, self.counts)):
            rng = np.random.default_rng([self.seed, epoch, i])
            passes = [rng.permutation(len(source)) for _ in range(-(-count // len(source)))]
            chosen = np.concatenate(passes)[:count] if passes else np.zeros(0, dtype=np.int64)
            source_ids.append(np.full(count, i, dtype=np.int32))
            rows.append(chosen)
        order = np.random.default_rng([self.seed, epoch, len(self.sources)]).permutation(self.num_rows)
        self.source_ids, self.rows = np.concatenate(source_ids)[order], np.concatenate(rows)[order]

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        return self.sources[self.source_ids[index]][int(self.rows[index])]

    def realised(self):
        """Per source: rows and non-padding tokens this epoch, and their shares (for the first log line)."""
        stats = []
        for i, source in enumerate(self.sources):
            rows = self.rows[self.source_ids == i]
            stats.append({"rows": len(rows), "tokens": _row_tokens(source, rows), "weight": self.weights[i]})
        all_tokens = [s["tokens"] for s in stats]
        for s in stats:
            s["row_share"] = s["rows"] / self.num_rows
            s["token_share"] = s["tokens"] / sum(all_tokens) if None not in all_tokens and sum(all_tokens) else None
        return stats
