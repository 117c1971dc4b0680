"""Peak memory and throughput of scripts/curate_data.py against plain JSON reading of the same corpus (Linux).

    python scripts/bench_curate.py --mb 100 400 --workers 2      # one row per size; the corpora are deleted after

Each size: a synthetic corpus of that many MB (English and Chinese documents, 10% exact copies, 10% paraphrases, in
--files JSONL files) is written to a temporary folder; curate_data runs on it with every step while the summed RSS
of its whole process tree (the run, datatrove's manager and workers) is sampled every 0.2 s; then one process reads
the same files with json.loads, line by line. Peak RSS flat across sizes = memory bounded by the stream, not the
corpus. The machine's load average is printed beside each row: figures from a loaded machine say so.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("time person year way day thing world life hand part child eye woman place work week case point company "
         "number group problem fact river mountain garden letter music window table paper system program question "
         "night story money water reason result change morning health market idea teacher history family friend "
         "village doctor kitchen winter summer language station picture bridge animal student forest island").split()
HAN = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]


def document(rng):
    """One synthetic document: Zipf-weighted English words, or Han characters with full stops."""
    if rng.random() < 0.7:
        words = rng.choices(WORDS, [1 / (i + 1) for i in range(len(WORDS))], k=rng.randint(80, 400))
        return " ".join(words).capitalize() + "."
    return "。".join("".join(rng.choices(HAN, k=rng.randint(10, 30))) for _ in range(rng.randint(8, 30))) + "。"


def write_corpus(folder, megabytes, files, seed=0):
    """`files` JSONL files of about `megabytes` MB in all: unique documents, exact copies and paraphrases."""
    rng, written, recent = random.Random(seed), 0, []
    handles = [open(os.path.join(folder, f"part{k}.jsonl"), "w", encoding="utf-8") for k in range(files)]
    while written < megabytes * 1e6:
        roll = rng.random()
        if recent and roll < 0.1:
            text = rng.choice(recent)
        elif recent and roll < 0.2:
            words = rng.choice(recent).split(" ")
            i = rng.randrange(max(len(words) - 1, 1))
            words[i:i + 2] = words[i:i + 2][::-1]
            text = " ".join(words)
        else:
            text = document(rng)
            recent = (recent + [text])[-1000:]
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        handles[rng.randrange(files)].write(line)
        written += len(line.encode("utf-8"))
    for handle in handles:
        handle.close()
    return written


def tree_memory(pid):
    """(summed RSS, summed PSS) in bytes of `pid` and all its descendants, from /proc: RSS counts a page shared by
    forked workers once per process, PSS splits it among them (the machine's real use)."""
    rss = pss = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                fields = dict(line.split()[:2] for line in f if line.split()[0] in ("Rss:", "Pss:"))
            rss, pss = rss + int(fields["Rss:"]) * 1024, pss + int(fields["Pss:"]) * 1024
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    stack += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue  # a process that ended between two reads
    return rss, pss


def curate(folder, workers):
    """(seconds, peak summed RSS, peak summed PSS) of curate_data on `folder`, all steps."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "curate_data.py"), "--data_path", folder, "--out_dir",
           os.path.join(folder, "curated"), "--workers", str(workers)]
    start, peak_rss, peak_pss = time.perf_counter(), 0, 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    while proc.poll() is None:
        rss, pss = tree_memory(proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"error: curate_data exited {proc.returncode}")
    return time.perf_counter() - start, peak_rss, peak_pss


def plain_read(folder):
    """Seconds to json.loads every line of the corpus in one process."""
    start = time.perf_counter()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for line in f:
                    json.loads(line)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, nargs="+", default=[100, 400], help="corpus sizes, MB")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--files", type=int, default=8, help="input files (datatrove splits work by file)")
    parser.add_argument("--tmp", default=None, help="folder for the corpora (default: the system's temp folder)")
    args = parser.parse_args()
    for megabytes in args.mb:
        folder = tempfile.mkdtemp(prefix="bench_curate_", dir=args.tmp)
        try:
            size = write_corpus(folder, megabytes, args.files)
            load_before = os.getloadavg()
            seconds, peak_rss, peak_pss = curate(folder, args.workers)
            read_seconds = plain_read(folder)
            with open(os.path.join(folder, "curated", "report.json"), encoding="utf-8") as f:
                report = json.load(f)
            kept = sum(t["documents"] for s in report["stages"] for t in s["tallies"] if t["step"] == "output")
            print(json.dumps({"corpus_mb": round(size / 1e6, 1), "workers": args.workers, "seconds": round(seconds, 1),
                              "curate_mb_per_s": round(size / 1e6 / seconds, 2), "peak_rss_mb": round(peak_rss / 1e6),
                              "peak_pss_mb": round(peak_pss / 1e6),
                              "json_read_mb_per_s": round(size / 1e6 / read_seconds, 1), "documents_kept": kept,
                              "load_average_before": load_before, "load_average_after": os.getloadavg()}),
                  flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
