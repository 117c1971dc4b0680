"""Many files, directories, globs and weighted mixtures of them, as one Dataset.

    resolve_data_spec("a.jsonl:0.7,shards/*.parquet:0.3")  ->  [(["/abs/a.jsonl"], 0.7), ([...shards...], 0.3)]
    load_data_spec(spec, make_dataset, seed)                  ->  the dataset itself (one file), or a MixtureDataset
                                                                (dataset/weighted_mixture.py, read for weights only)

Each file keeps its own token cache (make_dataset(path) builds it); a source is its files in order. A mixture's
epoch holds rows from each source in proportion to the weights, chosen from (seed, epoch) alone, so data order
stays a pure function of (seed, epoch) and resume stays exact. Without weights the sources are concatenated.
"""
import glob
import os

import numpy as np
from torch.utils.data import ConcatDataset

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


def load_data_spec(spec, make_dataset, seed=0):
    """The Dataset a --data_path names: make_dataset(file) for one file; sources concatenated or mixed otherwise."""
    sources = resolve_data_spec(spec)
    datasets = [ConcatDataset([make_dataset(f) for f in files]) if len(files) > 1 else make_dataset(files[0])
                for files, _ in sources]
    if sources[0][1] is None:  # no weights: every row of every file once
        return datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    from dataset.weighted_mixture import MixtureDataset  # read by a weighted --data_path only
    return MixtureDataset(datasets, [w for _, w in sources], seed)


def describe_mixture(dataset, sources_spec):
    """One line saying the realised mixture of a MixtureDataset, for the trainer's log; '' otherwise."""
    if not hasattr(dataset, "realised"):  # not a MixtureDataset (dataset/weighted_mixture.py)
        return ""
    names = [e.strip() for e in str(sources_spec).split(",") if e.strip()]
    parts = [f"{name.rpartition(':')[0] or name}: {s['rows']} rows ({s['row_share']:.1%})"
             + (f", {s['tokens']} tokens ({s['token_share']:.1%})" if s["token_share"] is not None else "")
             for name, s in zip(names, dataset.realised())]
    return "data mixture realised: " + "; ".join(parts)


def leaf_datasets(ds):
    """The per-file datasets under a ConcatDataset (.datasets) or a MixtureDataset (.sources); [] for None."""
    if ds is None:
        return []
    children = getattr(ds, "datasets", None) or getattr(ds, "sources", None)
    return [leaf for child in children for leaf in leaf_datasets(child)] if children else [ds]
