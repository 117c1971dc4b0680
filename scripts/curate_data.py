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
started again with the same flags redoes only the tasks that had not finished. Workers: one per core (--workers);
--executor ray runs the stages on a Ray cluster. Exit 2: bad input (the file and row), or no document kept; 3: disk
or a failing dependency; 130/143: stopped by SIGINT/SIGTERM.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import sys
import time
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datatrove.pipeline.decont import NGramsDecontConfig  # noqa: E402
from datatrove.pipeline.dedup import (  # noqa: E402
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
)
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactFindDedups  # noqa: E402
from datatrove.utils.hashing import HashConfig  # noqa: E402

from model.atomic import atomic_json, atomic_write_text  # noqa: E402
from scripts.curate.executor import StageFailed, run_stage, stop_ray  # noqa: E402
from scripts.curate.report import kept_documents, print_report, removed_examples, stage_report  # noqa: E402
from scripts.curate.rows import ParquetRowReader, RowReader, row_for_output, row_from_file  # noqa: E402
from scripts.curate.steps import (  # noqa: E402
    SAMPLE_CHARS,
    CharRatioFilter,
    DecontFilter,
    EvalFilesIndexer,
    ExactFilter,
    ExactSignatureOnTheWay,
    FastMinhashSignature,
    MixedScriptTokenizer,
    RankFileReader,
    RepetitionFilter,
    Tally,
    TokenSample,
    WorkWriter,
    document_row,
)

STEPS = ("quality", "decont", "exact", "near")
REMOVING_STEPS = ("length_and_ratios", "repetition", "decont", "exact", "near")  # tally labels, exclusion folders
JSONL_SUFFIXES, PARQUET_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst"), (".parquet",)
WORK_LAYOUT = 2  # what .work's stages write; an unfinished run of another layout is not continued
NOT_SETTINGS = ("workers", "keep_work", "quiet", "verbose", "executor", "ray_address")  # flags that shape no output


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


def fingerprints(files):
    """{path: [size, modification time in ns]} of each input file: what a rerun compares (as make and rsync do)."""
    return {path: [os.stat(path).st_size, os.stat(path).st_mtime_ns] for path in files}


def input_changes(saved, now):
    """A short account of how the input files differ between two fingerprints()."""
    saved = saved or {}
    changes = [f"{os.path.basename(p)} is new" for p in now if p not in saved]
    changes += [f"{os.path.basename(p)} is gone" for p in saved if p not in now]
    changes += [f"{os.path.basename(p)}: {saved[p][0]:,} -> {now[p][0]:,} bytes" if saved[p][0] != now[p][0] else
                f"{os.path.basename(p)} was modified" for p in now if p in saved and saved[p] != now[p]]
    return ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")


def readers(files, work, text_field):
    """One strict reader per file type (BadRow names a row it cannot read); each takes files rank::tasks of its list."""
    steps = []
    kinds = (("jsonl", JSONL_SUFFIXES, RowReader), ("parquet", PARQUET_SUFFIXES, ParquetRowReader))
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
                              short_words=args.short_line_words, language=MixedScriptTokenizer(),
                              exclusion_writer=removed("repetition")),
             Tally("repetition")]
    return steps


def stages(args, files, work):
    """[(name, pipeline, tasks, the work folder it reads or None)] in run order. The corpus is read three times: the
    first stage filters it into work/filtered and takes the exact signatures of what it writes; the near-duplicate
    signatures are taken of what the exact filter keeps of work/filtered; the last stage applies both filters to
    work/filtered again and writes work/final. Task r of a stage reads the file task r of the first stage wrote, so
    the signatures' document indices line up."""
    def folder(name):
        return os.path.join(work, name)

    def removed(step):  # a few removed documents per step, for the report
        return WorkWriter(folder(os.path.join("removed", step)), compression=None, adapter=document_row)

    def exact_filter(counted):  # the exact filter, counted (removed documents, tally) where it first runs
        if "exact" not in on:
            return []
        if counted:
            return [ExactFilter(folder("exact_dups"), exact, removed("exact")), Tally("exact")]
        return [ExactFilter(folder("exact_dups"), exact)]

    tasks, on = args.tasks, set(args.steps)
    hashes = HashConfig(precision=64, hash_fc="sha1")  # datatrove's xxhash calls need xxhash<4; sha1 needs nothing
    decont = NGramsDecontConfig(n_grams=args.decont_ngram, find_query_ngrams=True, hash_config=hashes)
    minhash = MinhashConfig(n_grams=args.shingle_size, num_buckets=args.minhash_buckets,
                            hashes_per_bucket=args.minhash_hashes, hash_config=hashes)
    exact = ExactDedupConfig(content_getter=normalised_text, hash_config=hashes)
    plan, first = [], filter_steps(args, files, work, removed, decont)
    if "decont" in on:
        plan.append(("decont_index", [EvalFilesIndexer(folder("decont_index"), args.eval_path, decont,
                                                       MixedScriptTokenizer())], 1, None))
    if "exact" in on:
        first.append(ExactSignatureOnTheWay(folder("exact_sig"), exact))
    plan.append(("filter", first + [WorkWriter(folder("filtered"), compression=None, adapter=document_row)], tasks,
                 None))
    if "exact" in on:
        plan.append(("exact_find", [ExactFindDedups(folder("exact_sig"), folder("exact_dups"), exact)], 1, None))
    last = [read(work, "filtered")]
    if "near" in on:
        plan += [("near_sig", [read(work, "filtered")] + exact_filter(True) + [FastMinhashSignature(
                     folder("near_sig"), minhash, MixedScriptTokenizer())], tasks, "filtered"),
                 ("near_buckets", [MinhashDedupBuckets(folder("near_sig"), folder("near_buckets"), config=minhash)],
                  args.minhash_buckets, None),
                 ("near_cluster", [MinhashDedupCluster(folder("near_buckets"), folder("near_remove"),
                                                       config=minhash)], 1, None)]
        last += exact_filter(False) + [MinhashDedupFilter(folder("near_remove"), exclusion_writer=removed("near")),
                                       Tally("near")]
    else:
        last += exact_filter(True)
    plan.append(("write", last + [Tally("output"), WorkWriter(folder("final"), compression=None,
                                                              adapter=row_for_output)], tasks, "filtered"))
    return plan


def filter_steps(args, files, work, removed, decont):
    """The first stage's steps before its writer: read, token sample, quality, decontamination."""
    steps = readers(files, work, args.text_field) + [TokenSample(args.tokenizer_path, args.token_sample),
                                                     Tally("input")]
    if "quality" in args.steps:
        steps += quality_steps(args, removed)
    if "decont" in args.steps:
        steps += [DecontFilter(os.path.join(work, "decont_index"), decont, removed("decont"), MixedScriptTokenizer()),
                  Tally("decont")]
    return steps


def read(work, folder):
    """Reader of an intermediate folder (datatrove's own row format, metadata kept): task r reads file r."""
    return RankFileReader(os.path.join(work, folder), compression=None)


def prepare_work(work, out_dir, settings, inputs, say):
    """Check that `work` continues a run of these flags on these input files (settings.json), or start one. Input
    changed since an unfinished run: start over; since a finished one: ValueError (its shards are stale)."""
    path = os.path.join(work, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("inputs") != inputs:
            changes = input_changes(saved.get("inputs"), inputs)
            if os.path.exists(os.path.join(out_dir, "report.json")):
                raise ValueError(f"{out_dir} was curated from other input ({changes}): its shards are stale; delete "
                                 f"{out_dir} (or give another --out_dir) to curate the input as it is now")
            say(f"the input changed since the unfinished run in {out_dir} ({changes}): starting over")
            shutil.rmtree(work)
        elif saved.get("settings") != settings:
            saved = saved.get("settings") or {}
            changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
            raise ValueError(f"{work} holds a run with other settings ({', '.join(changed)}); give those again, or "
                             f"delete {work} to start over")
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(path):
        atomic_json({"settings": settings, "inputs": inputs}, path)


def publish(work, out_dir):
    """Move the finished shards from work/final into out_dir (each move atomic); return their names."""
    final = os.path.join(work, "final")
    names = sorted(n for n in os.listdir(final) if n.endswith(".jsonl")) if os.path.isdir(final) else []
    for name in names:
        os.replace(os.path.join(final, name), os.path.join(out_dir, name))
    return names


def run_stages(args, files, work, report, say):
    """Run every stage in order (finished tasks skipped); when no document is left, the rest are skipped."""
    plan, left = stages(args, files, work), True
    for number, (name, pipeline, tasks, reads) in enumerate(plan, 1):
        left = left and not (reads and not input_files_in(os.path.join(work, reads)))
        if not left:  # every document was removed before this stage
            report["stages"].append({"stage": name, "skipped": "no document left", "tallies": [], "dropped": {},
                                     "decont": {}})
            continue
        start, logdir = time.perf_counter(), os.path.join(work, "logs", name)
        done = len(os.listdir(os.path.join(logdir, "completions"))) if os.path.isdir(logdir + "/completions") else 0
        run_stage(name, pipeline, tasks, args.workers, logdir, args.executor, args.verbose, args.ray_address)
        report["stages"].append(stage_report(name, logdir))
        say(f"[{number}/{len(plan)}] {name}: {tasks} task(s){f' ({done} done before)' if done else ''}, "
            f"{time.perf_counter() - start:.1f} s")


def run(args):
    """Run every stage (skipping tasks a previous run finished), then publish the shards and the report."""
    def say(line):  # progress, on stderr: stdout holds the report's table
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    files = input_files(args.data_path)
    work = os.path.join(args.out_dir, ".work")
    if not os.path.isdir(work) and input_files_in(args.out_dir):
        raise ValueError(f"--out_dir {args.out_dir} already holds data files; give an empty or new folder")
    settings = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}  # tasks stay: they are ranks
    settings["work_layout"] = WORK_LAYOUT
    inputs = fingerprints(files)
    prepare_work(work, args.out_dir, settings, inputs, say)
    if os.path.exists(os.path.join(args.out_dir, "report.json")):  # finished before, on this input: nothing to do
        with open(os.path.join(args.out_dir, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
        return show(report, args.quiet)
    size = sum(size for size, _ in inputs.values())
    say(f"curating {len(files)} file(s), {size / 1e6:,.1f} MB, into {args.out_dir}: steps {','.join(args.steps)}, "
        f"{args.workers} worker(s), {args.tasks} task(s) per stage; datatrove's logs in {work}/logs")
    report = {"settings": settings, "stages": [],
              "token_sample": {"every": args.token_sample, "max_chars": SAMPLE_CHARS,
                               "tokenizer": args.tokenizer_path}}
    try:
        run_stages(args, files, work, report, say)
    finally:
        stop_ray()
    report["shards"] = publish(work, args.out_dir)
    report["examples"] = {step: removed_examples(work, step) for step in REMOVING_STEPS}
    report["minhash_threshold"] = (1 / args.minhash_buckets) ** (1 / args.minhash_hashes)
    atomic_json(report, os.path.join(args.out_dir, "report.json"))
    if not args.keep_work:  # the intermediate copies of the corpus; logs and removed examples stay
        for folder in ("filtered", "exact_sig", "near_sig", "near_buckets"):
            shutil.rmtree(os.path.join(work, folder), ignore_errors=True)
    return show(report, args.quiet)


def show(report, quiet):
    """Print the report's table (unless quiet); ValueError when no document was kept: nothing to train on."""
    if not quiet:
        print_report(report)
    if not kept_documents(report):
        dropped = {k: v for stage in report["stages"] for k, v in stage["dropped"].items()}
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1])[:4])
        raise ValueError(f"no document was kept ({reasons or 'no input document'}): nothing to train on; the "
                         "thresholds are flags (--help), the report is report.json")
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
                   help="tokenizer.json (or its folder) whose tokens the report counts")
    p.add_argument("--token_sample", type=int, default=20, help="the report's tokens: counted on 1 in N documents "
                   f"(their first {SAMPLE_CHARS:,} characters) and scaled by characters; 1 counts every document")
    p.add_argument("--min_chars", type=int, default=20)
    p.add_argument("--max_chars", type=int, default=1_000_000)
    p.add_argument("--min_alnum_ratio", type=float, default=0.6, help="letters+digits among non-space chars")
    p.add_argument("--max_symbol_ratio", type=float, default=0.1, help="Unicode symbols among non-space chars")
    p.add_argument("--dup_line_frac", type=float, default=0.3, help="Gopher: duplicate lines / lines")
    p.add_argument("--dup_para_frac", type=float, default=0.3, help="Gopher: duplicate paragraphs / paragraphs")
    p.add_argument("--short_line_words", type=int, default=3, help="a duplicate line or paragraph of at most this "
                   "many words (a speaker's name, a list marker) is not duplicated text; 0: Gopher's count")
    p.add_argument("--decont_ngram", type=int, default=13, help="tokens (words; CJK characters) per n-gram")
    p.add_argument("--shingle_size", type=int, default=5, help="MinHash shingle: tokens (words; CJK characters)")
    p.add_argument("--minhash_buckets", type=int, default=14, help="LSH bands")
    p.add_argument("--minhash_hashes", type=int, default=6, help="hashes per band")
    p.add_argument("--keep_work", action="store_true", help="keep the intermediate copies in OUT_DIR/.work")
    p.add_argument("--executor", choices=("local", "ray"), default="local", help="datatrove's executor: local "
                   "processes, or Ray (pip install -r requirements-ray.txt) for a cluster")
    p.add_argument("--ray_address", default=None, help="a running Ray cluster (ray start ...; 'auto'); default: a "
                   "local Ray instance of --workers CPUs")
    p.add_argument("--quiet", action="store_true", help="print errors only (report.json has the report)")
    p.add_argument("--verbose", action="store_true", help="datatrove's own logs on stderr too (else in "
                   "OUT_DIR/.work/logs/<stage>/console.log)")
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
    if args.workers < 1 or args.tasks < 1 or args.token_sample < 1:
        p.error("--workers, --tasks and --token_sample must be at least 1")
    if os.path.isdir(args.tokenizer_path):  # a tokenizer folder (train_tokenizer.py's --out_dir, model/)
        args.tokenizer_path = os.path.join(args.tokenizer_path, "tokenizer.json")
    args.tokenizer_path = os.path.abspath(args.tokenizer_path)
    if not os.path.isfile(args.tokenizer_path):
        p.error(f"--tokenizer_path {args.tokenizer_path}: no such file")
    return args


class Terminated(BaseException):
    """SIGTERM arrived (raised in the main process by its handler); like KeyboardInterrupt, no `except Exception`
    (datatrove's included) takes it for a failure of the step it interrupts."""


def raise_terminated(signum, frame):
    raise Terminated()


def main(argv=None):
    args = parse_args(argv)
    # the workers are the parallelism: tokenizers' own threads, used here before a stage forks, would make each fork
    # print a warning (tokenizers 0.22) into the quiet output
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    except (OSError, StageFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:  # main() run in-process (tests, a caller's own script) leaves the process's handler as it found it
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
