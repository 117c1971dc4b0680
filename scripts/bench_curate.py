"""scripts/curate_data.py against a stock datatrove pipeline of the same steps (scripts/benchmarks/stock_curate.py), on
the same corpus in the same run, alternately: throughput and peak memory of each whole process tree (Linux).

    python scripts/bench_curate.py --mb 40 200 --workers 2 --pairs 2     # one row per run; the corpora are deleted

Each size: a synthetic corpus of that many MB (English and Chinese documents, 10% exact copies, 10% paraphrases, in
--files JSONL files) is written to a temporary folder; then --pairs pairs of runs, ours and stock's, the order
swapped every pair (ours first, then stock first, ...), each with every step, while the summed RSS and PSS of its
whole process tree (the run, datatrove's manager, forkserver and workers) are sampled every 0.2 s. Each row: seconds,
MB/s, peak RSS/PSS, documents kept, the load average before and after; the last line per size: ours/stock ratios
(MB/s, peak RSS, peak PSS; medians over the pairs) and the kept documents' difference. The machine line heads the
output: figures from a loaded machine say so.
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


def measured(cmd):
    """(seconds, peak summed RSS, peak summed PSS) of `cmd`'s whole process tree; SystemExit if it fails."""
    start, peak_rss, peak_pss = time.perf_counter(), 0, 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    while proc.poll() is None:
        rss, pss = tree_memory(proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd[:3])} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    return seconds, peak_rss, peak_pss


def command(who, corpus, out_dir, workers):
    """The command line of our curation or the stock pipeline, every step."""
    if who == "ours":
        return [sys.executable, os.path.join(ROOT, "scripts", "curate_data.py"), "--data_path", corpus, "--out_dir",
                out_dir, "--workers", str(workers), "--quiet"]
    return [sys.executable, "-m", "scripts.benchmarks.stock_curate", "--data_path", corpus, "--out_dir", out_dir,
            "--workers", str(workers)]


def kept_documents(out_dir):
    """Rows in the output shards of either pipeline."""
    total = 0
    for name in os.listdir(out_dir):
        if name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name), "rb") as f:
                total += sum(1 for _ in f)
    return total


def machine_line():
    """CPU model, its vector extensions, cores, memory."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = [f for f in ("avx512f", "avx512_bf16", "avx2") if f" {f} " in info]
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{model}, {'/'.join(flags) or 'no AVX2'}, {os.cpu_count()} cores, {memory:.0f} GiB"


def median(values):
    values = sorted(values)
    return (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2


def bench_size(folder, megabytes, args):
    """Write the corpus, run the pairs alternately, print one row per run and the ratios."""
    corpus = os.path.join(folder, "corpus")
    os.makedirs(corpus)
    size = write_corpus(corpus, megabytes, args.files)
    rows = {"ours": [], "stock": []}
    for pair in range(args.pairs):
        for who in (("ours", "stock") if pair % 2 == 0 else ("stock", "ours")):
            out_dir, load = os.path.join(folder, f"{who}{pair}"), os.getloadavg()
            seconds, rss, pss = measured(command(who, corpus, out_dir, args.workers))
            row = {"corpus_mb": round(size / 1e6, 1), "run": who, "pair": pair, "seconds": round(seconds, 1),
                   "mb_per_s": round(size / 1e6 / seconds, 3), "peak_rss_mb": round(rss / 1e6),
                   "peak_pss_mb": round(pss / 1e6), "documents_kept": kept_documents(out_dir),
                   "load_before": [round(x, 1) for x in load], "load_after": [round(x, 1) for x in os.getloadavg()]}
            rows[who].append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out_dir, ignore_errors=True)
    ratio = {key: round(median(r[key] for r in rows["ours"]) / median(r[key] for r in rows["stock"]), 2)
             for key in ("mb_per_s", "peak_rss_mb", "peak_pss_mb")}
    kept = [r["documents_kept"] for r in rows["ours"] + rows["stock"]]
    print(json.dumps({"corpus_mb": round(size / 1e6, 1), "ours_over_stock": ratio,
                      "kept_ours": rows["ours"][0]["documents_kept"], "kept_stock": rows["stock"][0]["documents_kept"],
                      "kept_spread_percent": round(100 * (max(kept) - min(kept)) / max(kept), 2)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, nargs="+", default=[40], help="corpus sizes, MB")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--files", type=int, default=8, help="input files (datatrove splits work by file)")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each pipeline per size, alternating")
    parser.add_argument("--tmp", default=None, help="folder for the corpora (default: the system's temp folder)")
    args = parser.parse_args()
    print(json.dumps({"machine": machine_line(), "command": " ".join(sys.argv)}), flush=True)
    for megabytes in args.mb:
        folder = tempfile.mkdtemp(prefix="bench_curate_", dir=args.tmp)
        try:
            bench_size(folder, megabytes, args)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
