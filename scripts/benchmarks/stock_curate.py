"""The peer of scripts/bench_curate.py: scripts/curate_data.py's steps as a stock datatrove pipeline, run as datatrove's
docs show (LocalPipelineExecutor with its defaults: a forkserver, one executor per stage).

    python -m scripts.benchmarks.stock_curate --data_path DIR --out_dir OUT --workers 2     # from the repository root

Same steps, same thresholds, stock blocks: the length and character-ratio rule as a LambdaFilter (per-character
unicodedata), datatrove's own GopherRepetitionFilter (its default rules: Gopher's top n-gram rule included),
ExactDedupSignature/Find/Filter on the same normalised text, MinhashDedupSignature/Buckets/Cluster/Filter at the same
14x6 on 5-token shingles, JsonlReader/JsonlWriter. Words are steps.MixedScriptTokenizer's (a datatrove WordTokenizer:
datatrove's own would read an unspaced Chinese sentence as one word), so both pipelines see the same tokens. No token
count and no files of removed documents: the report's extras are the curation's own cost, not the peer's.
"""
import argparse
import os
import unicodedata

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.filters import GopherRepetitionFilter, LambdaFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig

from scripts.curate.steps import MixedScriptTokenizer


def length_and_ratios(doc):
    """scripts/curate_data.py's rule at its defaults, written plainly: 20..1,000,000 characters, letters and digits
    at least 0.6 of the non-space characters, symbols outside ASCII (Unicode S*) at most 0.1."""
    if not 20 <= len(doc.text) <= 1_000_000:
        return False
    visible = [ch for ch in doc.text if not ch.isspace()]
    categories = [unicodedata.category(ch)[0] for ch in visible]
    alnum = sum(c in "LN" for c in categories)
    symbols = sum(c == "S" and not ch.isascii() for ch, c in zip(visible, categories))
    return alnum >= 0.6 * len(visible) and symbols <= 0.1 * len(visible)


def normalised_text(doc):
    """What exact deduplication compares, as in scripts/curate_data.py: NFKC, lower case, whitespace runs as one."""
    return " ".join(unicodedata.normalize("NFKC", doc.text).lower().split())


def stages(data_path, out_dir, tasks):
    """[(name, pipeline, tasks)] in run order."""
    work = os.path.join(out_dir, ".work")
    hashes = HashConfig(precision=64, hash_fc="sha1")
    minhash = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=6, hash_config=hashes)
    exact = ExactDedupConfig(content_getter=normalised_text, hash_config=hashes)
    words = MixedScriptTokenizer()
    return [
        ("filter", [JsonlReader(data_path), LambdaFilter(length_and_ratios),
                    GopherRepetitionFilter(language=words), JsonlWriter(f"{work}/filtered", compression=None)], tasks),
        ("exact_sig", [JsonlReader(f"{work}/filtered", compression=None),
                       ExactDedupSignature(f"{work}/exact_sig", exact)], tasks),
        ("exact_find", [ExactFindDedups(f"{work}/exact_sig", f"{work}/exact_dups", exact)], 1),
        ("exact_filter", [JsonlReader(f"{work}/filtered", compression=None),
                          ExactDedupFilter(f"{work}/exact_dups", exact),
                          JsonlWriter(f"{work}/exact", compression=None)], tasks),
        ("near_sig", [JsonlReader(f"{work}/exact", compression=None),
                      MinhashDedupSignature(f"{work}/near_sig", minhash, language=words)], tasks),
        ("near_buckets", [MinhashDedupBuckets(f"{work}/near_sig", f"{work}/near_buckets", config=minhash)], 14),
        ("near_cluster", [MinhashDedupCluster(f"{work}/near_buckets", f"{work}/near_remove", config=minhash)], 1),
        ("write", [JsonlReader(f"{work}/exact", compression=None), MinhashDedupFilter(f"{work}/near_remove"),
                   JsonlWriter(out_dir, compression=None)], tasks),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", required=True, help="a folder of JSONL files ({'text': ...} rows)")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    for name, pipeline, tasks in stages(os.path.abspath(args.data_path), os.path.abspath(args.out_dir), args.workers):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, args.workers),
                              logging_dir=os.path.join(args.out_dir, ".work", "logs", name)).run()


if __name__ == "__main__":
    main()
