"""Curate a raw corpus into training shards with HF's datatrove: quality filters, decontamination, exact and near
duplicates, and a report of what each step removed.

    python scripts/curate_data.py --data_path raw/*.jsonl --out_dir curated           # {"text": ...} rows
    python scripts/curate_data.py --data_path sft.jsonl --text_field conversations --out_dir sft_curated
    python scripts/curate_data.py --data_path raw/ --eval_path mmlu.jsonl,ceval.jsonl --out_dir curated

Steps, in order, each switchable (docs/curation.md states every threshold):
  1. quality: length and character ratios (CharRatioFilter), then Gopher's repetition filter (duplicate lines,
     paragraphs, top and duplicated n-grams); n-grams count words in spaced text and characters in CJK text;
  2. decont: drop documents sharing a 13-gram (words; CJK characters) with any --eval_path file, counted per file;
  3. exact: drop documents whose normalised text (NFKC, lower case, whitespace collapsed) was seen before;
  4. near: MinHash LSH on 5-gram shingles: --minhash_buckets bands of --minhash_hashes hashes, so pairs with Jaccard
     similarity above about (1/bands)^(1/hashes) are caught; one document of each cluster is kept.
Output: CURATED/00000.jsonl ... (rows as they came in; the trainer reads the folder as --data_path) and
CURATED/report.json. Work files (datatrove's logs and completion markers) stay in CURATED/.work: a killed run
started again with the same flags redoes only the tasks that had not finished. Workers: one per core (--workers).
"""
import argparse
import glob
import json
import os
import shutil
import signal
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter  # noqa: E402
from datatrove.pipeline.dedup import (  # noqa: E402
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
)
from datatrove.pipeline.dedup.exact_dedup import (  # noqa: E402
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.readers import JsonlReader, ParquetReader  # noqa: E402
from datatrove.pipeline.tokens import TokensCounter  # noqa: E402
from datatrove.pipeline.writers import JsonlWriter  # noqa: E402
from datatrove.utils.hashing import HashConfig  # noqa: E402

from model.atomic import atomic_json, atomic_write_text  # noqa: E402
from scripts.curate.report import print_report, removed_examples, stage_report  # noqa: E402
from scripts.curate.steps import (  # noqa: E402
    CharRatioFilter,
    EvalFilesIndexer,
    FastMinhashSignature,
    MixedScriptTokenizer,
    RepetitionFilter,
    Tally,
    row_for_output,
    row_from_file,
)

STEPS = ("quality", "decont", "exact", "near")
REMOVING_STEPS = ("length_and_ratios", "repetition", "decont", "exact", "near")  # tally labels, exclusion folders
JSONL_SUFFIXES, PARQUET_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst"), (".parquet",)


def normalised_text(doc) -> str:
    """What exact deduplication compares: NFKC, lower case, runs of whitespace as one space."""
    return " ".join(unicodedata.normalize("NFKC", doc.text).lower().split())


def input_files(specs):
    """Sorted data files from files, folders (searched recursively) and globs; ValueError naming what matched none."""
    files = []
    for spec in specs:
        path = os.path.abspath(os.path.expanduser(spec))
        if os.path.isdir(path):
            found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
        else:
            found = glob.glob(path)
        found = sorted(f for f in found if os.path.isfile(f) and f.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES))
        if not found:
            raise ValueError(f"--data_path {spec}: no .jsonl or .parquet file there")
        files += [f for f in found if f not in files]
    return files


def input_files_in(folder):
    """The data files directly in `folder` (none if it does not exist)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return [n for n in names if n.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)]


def readers(files, work, text_field):
    """One datatrove reader per file type; each takes files rank::workers of its list."""
    steps = []
    kinds = (("jsonl", JSONL_SUFFIXES, JsonlReader), ("parquet", PARQUET_SUFFIXES, ParquetReader))
    for kind, suffixes, reader in kinds:
        chosen = [f for f in files if f.endswith(suffixes)]
        if chosen:
            paths_file = os.path.join(work, f"inputs_{kind}.txt")
            atomic_write_text(paths_file, "".join(os.path.relpath(p, "/") + "\n" for p in chosen))
            steps.append(reader("/", paths_file=paths_file, text_key=text_field, adapter=row_from_file))
    return steps


def quality_steps(args, removed):
    steps = [CharRatioFilter(args.min_chars, args.max_chars, args.min_alnum_ratio, args.max_symbol_ratio,
                             exclusion_writer=removed("length_and_ratios")), Tally("length_and_ratios"),
             RepetitionFilter(dup_line_frac=args.dup_line_frac, dup_para_frac=args.dup_para_frac,
                              language=MixedScriptTokenizer(), exclusion_writer=removed("repetition")),
             Tally("repetition")]
    return steps


def stages(args, files, work):
    """[(name, pipeline, tasks)] in run order; the last writes the final shards to work/final."""
    def removed(step):  # a few removed documents per step, for the report
        return JsonlWriter(os.path.join(work, "removed", step), compression=None)

    def writer(folder, final=False):
        return JsonlWriter(os.path.join(work, folder), compression=None, adapter=row_for_output if final else None)

    tasks, on = args.tasks, set(args.steps)
    hashes = HashConfig(precision=64, hash_fc="sha1")  # datatrove's xxhash calls need xxhash<4; sha1 needs nothing
    decont = NGramsDecontConfig(n_grams=args.decont_ngram, find_query_ngrams=True, hash_config=hashes)
    minhash = MinhashConfig(n_grams=args.shingle_size, num_buckets=args.minhash_buckets,
                            hashes_per_bucket=args.minhash_hashes, hash_config=hashes)
    exact = ExactDedupConfig(content_getter=normalised_text, hash_config=hashes)
    first = readers(files, work, args.text_field) + [TokensCounter(args.tokenizer_path, batch_size=64),
                                                     Tally("input")]
    if "quality" in on:
        first += quality_steps(args, removed)
    plan = []
    if "decont" in on:
        plan.append(("decont_index", [EvalFilesIndexer(os.path.join(work, "decont_index"), args.eval_path, decont,
                                                       MixedScriptTokenizer())], 1))
        first += [NGramsDecontFilter(os.path.join(work, "decont_index"), decont, removed("decont"),
                                     MixedScriptTokenizer()), Tally("decont")]
    plan.append(("filter", first + [writer("filtered")], tasks))
    source = "filtered"
    if "exact" in on:
        plan += [("exact_sig", [read(work, source), ExactDedupSignature(os.path.join(work, "exact_sig"), exact)],
                  tasks),
                 ("exact_find", [ExactFindDedups(os.path.join(work, "exact_sig"), os.path.join(work, "exact_dups"),
                                                 exact)], 1),
                 ("exact_filter", [read(work, source), ExactDedupFilter(os.path.join(work, "exact_dups"), exact,
                                                                        removed("exact")), Tally("exact"),
                                   writer("exact")], tasks)]
        source = "exact"
    last = [read(work, source)]
    if "near" in on:
        plan += [("near_sig", [read(work, source), FastMinhashSignature(os.path.join(work, "near_sig"), minhash,
                                                                         MixedScriptTokenizer())], tasks),
                 ("near_buckets", [MinhashDedupBuckets(os.path.join(work, "near_sig"),
                                                       os.path.join(work, "near_buckets"), config=minhash)],
                  args.minhash_buckets),
                 ("near_cluster", [MinhashDedupCluster(os.path.join(work, "near_buckets"),
                                                       os.path.join(work, "near_remove"), config=minhash)], 1)]
        last += [MinhashDedupFilter(os.path.join(work, "near_remove"), exclusion_writer=removed("near")),
                 Tally("near")]
    plan.append(("write", last + [Tally("output"), writer("final", final=True)], tasks))
    return plan


def read(work, folder):
    """Reader of an intermediate folder (datatrove's own row format, metadata kept)."""
    return JsonlReader(os.path.join(work, folder), compression=None)


def check_same_flags(work, settings):
    """A restart must use the flags of the run it continues: their work files would not mix."""
    path = os.path.join(work, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved != settings:
            changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
            raise ValueError(f"{work} holds a run with other settings ({', '.join(changed)}); give those again, or "
                             f"delete {work} to start over")
    else:
        atomic_json(settings, path)


def publish(work, out_dir):
    """Move the finished shards from work/final into out_dir (each move atomic); return their names."""
    final = os.path.join(work, "final")
    names = sorted(n for n in os.listdir(final) if n.endswith(".jsonl")) if os.path.isdir(final) else []
    for name in names:
        os.replace(os.path.join(final, name), os.path.join(out_dir, name))
    return names


def run(args):
    """Run every stage (skipping tasks a previous run finished), then publish the shards and the report."""
    files = input_files(args.data_path)
    work = os.path.join(args.out_dir, ".work")
    if not os.path.isdir(work) and input_files_in(args.out_dir):
        raise ValueError(f"--out_dir {args.out_dir} already holds data files; give an empty or new folder")
    os.makedirs(work, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("workers", "keep_work")}  # tasks stay: ranks
    settings["files"] = files
    check_same_flags(work, settings)
    if os.path.exists(os.path.join(args.out_dir, "report.json")):  # finished before: nothing left to do
        with open(os.path.join(args.out_dir, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
        print_report(report)
        return report
    report = {"settings": settings, "stages": []}
    for name, pipeline, tasks in stages(args, files, work):
        executor = LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(tasks, args.workers),
                                         logging_dir=os.path.join(work, "logs", name))
        executor.run()
        report["stages"].append(stage_report(name, os.path.join(work, "logs", name)))
    report["shards"] = publish(work, args.out_dir)
    report["examples"] = {step: removed_examples(work, step) for step in REMOVING_STEPS}
    report["minhash_threshold"] = (1 / args.minhash_buckets) ** (1 / args.minhash_hashes)
    atomic_json(report, os.path.join(args.out_dir, "report.json"))
    print_report(report)
    if not args.keep_work:  # the intermediate copies of the corpus; logs and removed examples stay
        for folder in ("filtered", "exact", "exact_sig", "near_sig", "near_buckets"):
            shutil.rmtree(os.path.join(work, folder), ignore_errors=True)
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", nargs="+", required=True, help="JSONL/parquet files, folders or globs")
    p.add_argument("--out_dir", required=True, help="folder for the shards and report.json")
    p.add_argument("--text_field", default="text", help="the row's text field; 'conversations' for SFT rows")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--eval_path", default="", help="comma list of JSONL files of benchmark items (decont)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (1: all tasks in this one)")
    p.add_argument("--tasks", type=int, default=None, help="tasks per stage, each its input files' share "
                   "(default: --workers); finished tasks are not redone after a kill")
    p.add_argument("--tokenizer_path", default=os.path.join(ROOT, "model", "tokenizer.json"),
                   help="tokenizer.json whose tokens the report counts")
    p.add_argument("--min_chars", type=int, default=20)
    p.add_argument("--max_chars", type=int, default=1_000_000)
    p.add_argument("--min_alnum_ratio", type=float, default=0.6, help="letters+digits among non-space chars")
    p.add_argument("--max_symbol_ratio", type=float, default=0.1, help="Unicode symbols among non-space chars")
    p.add_argument("--dup_line_frac", type=float, default=0.3, help="Gopher: duplicate lines / lines")
    p.add_argument("--dup_para_frac", type=float, default=0.3, help="Gopher: duplicate paragraphs / paragraphs")
    p.add_argument("--decont_ngram", type=int, default=13, help="tokens (words; CJK characters) per n-gram")
    p.add_argument("--shingle_size", type=int, default=5, help="MinHash shingle: tokens (words; CJK characters)")
    p.add_argument("--minhash_buckets", type=int, default=14, help="LSH bands")
    p.add_argument("--minhash_hashes", type=int, default=6, help="hashes per band")
    p.add_argument("--keep_work", action="store_true", help="keep the intermediate copies in OUT_DIR/.work")
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    args.eval_path = [e for e in args.eval_path.split(",") if e]
    args.out_dir = os.path.abspath(args.out_dir)
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        p.error(f"--steps {','.join(unknown)} unknown; choose from {','.join(STEPS)}")
    if "decont" in args.steps and not args.eval_path:
        args.steps.remove("decont")  # nothing to decontaminate against
    missing = [e for e in args.eval_path if not os.path.isfile(e)]
    if missing:
        p.error(f"--eval_path {', '.join(missing)}: no such file")
    args.eval_path = [os.path.abspath(e) for e in args.eval_path]
    args.tasks = args.tasks or args.workers
    if args.workers < 1 or args.tasks < 1:
        p.error("--workers and --tasks must be at least 1")
    return args


class Terminated(Exception):
    """SIGTERM arrived (raised in the main process by its handler)."""


def raise_terminated(signum, frame):
    raise Terminated()


def main(argv=None):
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        run(args)
    except (KeyboardInterrupt, Terminated) as e:
        print(f"error: stopped by {'SIGINT' if isinstance(e, KeyboardInterrupt) else 'SIGTERM'}; the same command "
              "continues (finished tasks are kept)", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:  # main() run in-process (tests, a caller's own script) leaves the process's handler as it found it
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
