"""Many files, directories, globs and weighted mixtures of them, as one Dataset.

    resolve_data_spec("a.jsonl:0.7,shards/*.parquet:0.3")  ->  [(["/abs/a.jsonl"], 0.7), ([...shards...], 0.3)]
    load_data_spec(spec, make_dataset, seed)                  ->  the dataset itself (one file), or a MixtureDataset

Each file keeps its own token cache (make_dataset(path) builds it); a source is its files in order. A mixture's
epoch holds rows from each source in proportion to the weights, chosen from (seed, epoch) alone, so data order
stays a pure function of (seed, epoch) and resume stays exact. Without weights the sources are concatenated.
"""
import glob
import os

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

DATA_SUFFIXES = (".jsonl", ".parquet", ".bin")  # corpora, and shards from scripts/pretokenize.py


def _parse_entry(entry):
    """(path, weight or None) from `path` or `path:weight`."""
    path, sep, weight = entry.rpartition(":")
    if sep:
        try:
            value = float(weight)
        except ValueError:
            return entry, None  # a ':' inside the path
        if not value > 0 or not np.isfinite(value):
            raise ValueError(f"{entry}: the weight after ':' must be a positive number")
        return path, value
    return entry, None


def _expand(path):
    """The data files a path names: the file itself, a directory's data files, or a glob's matches, sorted."""
    path = os.path.abspath(os.path.expanduser(path))  # typed paths resolve against the current directory
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = [os.path.join(path, name) for name in sorted(os.listdir(path))]
    else:
        files = sorted(glob.glob(path))
    files = [f for f in files if os.path.isfile(f) and f.endswith(DATA_SUFFIXES)]
    if not files:
        what = ("is a directory with no data file" if os.path.isdir(path)
                else "does not exist" if not glob.has_magic(path)
                else "matches no data file")
        raise FileNotFoundError(f"{path} {what} (give a file, a directory or a glob of {', '.join(DATA_SUFFIXES)})")
    return files


def resolve_data_spec(spec):
    """[(files, weight)] from a comma list of files, directories or globs, each optionally `:weight`.

    Weights are normalized to sum to 1; give them to every source or to none (None: concatenate).
    """
    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if not entries:
        raise ValueError("empty data path")
    parsed = [_parse_entry(e) for e in entries]
    weighted = [w is not None for _, w in parsed]
    if any(weighted) and not all(weighted):
        raise ValueError(f"{spec}: give a ':weight' to every source or to none")
    total = sum(w for _, w in parsed) if all(weighted) else None
    return [(_expand(path), w / total if total else None) for path, w in parsed]


def absolute_data_spec(spec):
    """The same spec with every source path made absolute (typed paths resolve against the current directory)."""
    entries = [_parse_entry(e.strip()) for e in str(spec).split(",") if e.strip()]
    return ",".join(os.path.abspath(os.path.expanduser(path)) + ("" if weight is None else f":{weight:g}")
                    for path, weight in entries)


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


def load_data_spec(spec, make_dataset, seed=0):
    """The Dataset a --data_path names: make_dataset(file) for one file; sources concatenated or mixed otherwise."""
    sources = resolve_data_spec(spec)
    datasets = [ConcatDataset([make_dataset(f) for f in files]) if len(files) > 1 else make_dataset(files[0])
                for files, _ in sources]
    if sources[0][1] is None:  # no weights: every row of every file once
        return datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    return MixtureDataset(datasets, [w for _, w in sources], seed)


def describe_mixture(dataset, sources_spec):
    """One line saying the realised mixture of a MixtureDataset, for the trainer's log; '' otherwise."""
    if not isinstance(dataset, MixtureDataset):
        return ""
    names = [e.strip() for e in str(sources_spec).split(",") if e.strip()]
    parts = [f"{name.rpartition(':')[0] or name}: {s['rows']} rows ({s['row_share']:.1%})"
             + (f", {s['tokens']} tokens ({s['token_share']:.1%})" if s["token_share"] is not None else "")
             for name, s in zip(names, dataset.realised())]
    return "data mixture realised: " + "; ".join(parts)
