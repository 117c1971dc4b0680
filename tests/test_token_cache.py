"""The token cache built by several local ranks / worker processes / nodes equals the single-process one, byte
for byte; bad lines stop every rank with the original file:line; stale locks are taken over.

Run as __main__, this file is one rank (the tests fork it: tests/helpers/launch.py start_forked; by hand, from the repo
root: `python -m tests.test_token_cache KIND DATA CACHE_DIR RANK PARTS NUM_PROC`).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import pytest
from transformers import AutoTokenizer

import dataset.tokenizing.token_cache as token_cache
from dataset.chat import SFTDataset
from dataset.lm_dataset import PretrainDataset
from dataset.tokenizing.file_ranges import lines_before, split_range
from dataset.tokenizing.token_cache import CacheBuildInterrupted, build_token_cache
from tests.helpers.launch import demo_slice, forked, start_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = "tests/test_token_cache.py"  # one rank: this file as __main__ (tests/helpers/launch.py start_forked)
CACHE_FILES = ("tokens.bin", "offsets.bin", "mask.bin", "meta.json")
DATASETS = {"pretrain": PretrainDataset, "sft": SFTDataset}
BIG_REPEAT = 16  # copies of a 5000-line demo slice: ~30 MB, over 10 s of tokenizing on two busy cores



def cache_bytes(cache_path):
    """{file name: bytes} of a complete cache (mask.bin only where there is one)."""
    return {name: open(os.path.join(cache_path, name), "rb").read()
            for name in CACHE_FILES if os.path.exists(os.path.join(cache_path, name))}


def reference(kind, path, tokenizer, cache_dir):
    """The single-process, single-worker cache: what every other layout must reproduce."""
    return DATASETS[kind](path, tokenizer, max_length=16, cache_dir=cache_dir, num_proc=1)


def launch_ranks(kind, path, cache_dir, num_parts, num_proc, nodes=1, timeout=180):
    """Start nodes x num_parts rank processes at once; return [(node, returncode, stdout + stderr)]. The ranks are
    forked from this process (tests/helpers/launch.py start_forked: this file as __main__, torch and transformers
    imported
    already); they meet only through the files under cache_dir, as fresh interpreters would."""
    log_dir, procs = tempfile.mkdtemp(), []
    for node in range(nodes):
        for rank in range(num_parts):
            log = os.path.join(log_dir, f"{node}_{rank}.log")
            procs.append((node, log, start_forked(RANK, [kind, path, cache_dir, rank, num_parts, num_proc], log,
                                                  env={"GROUP_RANK": str(node)})))
    results = []
    deadline = time.time() + timeout
    try:
        for node, log, p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
            with open(log) as f:
                results.append((node, p.returncode, f.read()))
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        shutil.rmtree(log_dir, ignore_errors=True)
    return results


def rank_main(kind, path, cache_dir, rank, num_parts, num_proc):
    """One local rank: build (or wait for) the cache; print whether it tokenized, or `error: ...` and exit 2."""
    tokenized = []
    build = token_cache.build_token_cache  # shards._build_cache imports it on a miss, reading this attribute then
    token_cache.build_token_cache = lambda *a, **k: tokenized.append(build(*a, **k))  # record the return value
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    try:
        ds = DATASETS[kind](path, tokenizer, max_length=16, cache_dir=cache_dir, num_proc=int(num_proc),
                            part=(int(rank), int(num_parts)))
    except ValueError as e:
        print(f"error: {e}")
        sys.exit(2)
    except CacheBuildInterrupted as e:  # what the trainer's main_guard does with it
        print(f"error: {e}", flush=True)
        sys.exit(128 + e.signum)
    print(json.dumps({"tokenized": bool(tokenized and tokenized[0]), "cache_path": ds.cache_path}))


def ok_results(results):
    for node, rc, out in results:
        assert rc == 0, out
    return [json.loads(out.strip().splitlines()[-1]) for _, _, out in results]


# ----------------------------------------------------------------------------- ranges

def test_split_range_cuts_at_line_starts(tmp_path):
    lines = [b'{"text": "%s"}\n' % (b"x" * n) for n in (3, 40, 1, 17, 5, 60, 2)]
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"".join(lines))
    starts = [sum(map(len, lines[:i])) for i in range(len(lines) + 1)]  # every line start, and the end
    for pieces in (1, 2, 3, 5, 7):
        ranges = split_range(str(path), 0, starts[-1], pieces)
        assert ranges[0][0] == 0 and ranges[-1][1] == starts[-1]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(a in starts and b in starts for a, b in ranges)
    assert [lines_before(str(path), s) for s in starts] == list(range(len(lines) + 1))


# ----------------------------------------------------------------------------- byte-identical layouts

@pytest.mark.parametrize("kind,num_lines,num_parts", [("pretrain", 400, 3), ("sft", 60, 2)])
def test_ranks_and_workers_write_the_single_process_bytes(tokenizer, tmp_path, kind, num_lines, num_parts):
    path = demo_slice(tmp_path, kind, num_lines)
    expected = cache_bytes(reference(kind, path, tokenizer, str(tmp_path / "ref")).cache_path)
    assert ("mask.bin" in expected) == (kind == "sft")
    results = ok_results(launch_ranks(kind, path, str(tmp_path / "par"), num_parts, num_proc=2))
    assert all(r["tokenized"] for r in results)  # every local rank did its part
    assert len({r["cache_path"] for r in results}) == 1
    assert cache_bytes(results[0]["cache_path"]) == expected
    assert sorted(os.listdir(tmp_path / "par")) == [os.path.basename(results[0]["cache_path"])]  # no leftovers


def test_two_nodes_on_a_shared_cache_dir_build_once(tokenizer, tmp_path):
    path = demo_slice(tmp_path, "pretrain", 300)
    expected = cache_bytes(reference("pretrain", path, tokenizer, str(tmp_path / "ref")).cache_path)
    results = launch_ranks("pretrain", path, str(tmp_path / "shared"), 2, num_proc=1, nodes=2)
    tokenized = [(node, r["tokenized"]) for (node, _, _), r in zip(results, ok_results(results))]
    builders = {node for node, did in tokenized if did}
    assert len(builders) == 1 and sum(did for _, did in tokenized) == 2  # one node, both its ranks
    assert cache_bytes(ok_results(results)[0]["cache_path"]) == expected


def test_parquet_row_groups_match_jsonl(tokenizer, tmp_path):
    texts = [f"document {i}: " + "words " * (i % 13) for i in range(50)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    parquet = str(tmp_path / "t.parquet")
    pd.DataFrame({"text": texts}).to_parquet(parquet, row_group_size=7)  # 8 row groups: 8 worker tasks
    expected = cache_bytes(reference("pretrain", str(jsonl), tokenizer, str(tmp_path / "ref")).cache_path)
    got = cache_bytes(PretrainDataset(parquet, tokenizer, max_length=16, cache_dir=tmp_path / "c",
                                      num_proc=2).cache_path)
    assert {k: v for k, v in got.items() if k != "meta.json"} == \
        {k: v for k, v in expected.items() if k != "meta.json"}
    pd.DataFrame({"text": texts[:22] + [None] + texts[23:]}).to_parquet(parquet, row_group_size=7)
    with pytest.raises(ValueError, match=r"t\.parquet:23: 'text' is null"):  # row 23 is in the 4th row group
        PretrainDataset(parquet, tokenizer, max_length=16, cache_dir=tmp_path / "c", num_proc=2)


# ----------------------------------------------------------------------------- errors and locks

def test_bad_line_stops_every_rank_with_the_same_file_line(tmp_path):
    path = demo_slice(tmp_path, "pretrain", 300)
    with open(path) as f:
        lines = f.readlines()
    lines[250] = '{"text": "cut off\n'  # line 251: in the second rank's half, far from its first line
    with open(path, "w") as f:
        f.writelines(lines)
    start = time.time()
    results = launch_ranks("pretrain", path, str(tmp_path / "cache"), 2, num_proc=2, timeout=150)
    expected = f"error: {path}:251: malformed JSON"
    for _, rc, out in results:
        assert rc == 2 and out.strip().splitlines()[-1].startswith(expected), out
    assert time.time() - start < 120  # failed fast, no rank waited for a timeout
    names = os.listdir(tmp_path / "cache")  # no cache, no half cache: the lock, the error and the finished parts
    assert not any("tmp" in name or os.path.exists(tmp_path / "cache" / name / "meta.json") for name in names), names


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("holder,age,takes_over", [
    ({"host": socket.gethostname(), "pid": None}, 0, True),  # same host, builder's pid gone
    ({"host": "elsewhere", "pid": 1}, 3600, True),  # other host, lock not touched for an hour
    ({"host": "elsewhere", "pid": 1}, 0, False),  # other host, alive: wait (here: time out)
])
def test_stale_lock_is_taken_over(tokenizer, tmp_path, holder, age, takes_over):
    path = demo_slice(tmp_path, "pretrain", 50)
    ds = reference("pretrain", path, tokenizer, str(tmp_path / "ref"))
    out_dir = str(tmp_path / "c" / "cache")
    os.makedirs(tmp_path / "c")
    holder = dict(holder, node="other/0", parts=1, since=time.time() - age, pid=holder["pid"] or dead_pid())
    with open(out_dir + ".lock", "w") as f:
        json.dump(holder, f)
    os.utime(out_dir + ".lock", (time.time() - age, time.time() - age))
    build = lambda: build_token_cache(out_dir, path, "text", ds._tokenized_chunks, ds.token_dtype,  # noqa: E731
                                      num_proc=1, wait_timeout=1)
    if takes_over:
        assert build() is True
        assert cache_bytes(out_dir) == cache_bytes(ds.cache_path)
        assert not os.path.exists(out_dir + ".lock")
    else:
        with pytest.raises(TimeoutError, match="remove .*cache.lock"):
            build()
        assert not os.path.exists(out_dir)


def test_killed_build_leaves_no_cache_and_is_taken_over(tokenizer, tmp_path):
    source = demo_slice(tmp_path, "pretrain", 5000)
    path = str(tmp_path / "big.jsonl")
    with open(source) as f, open(path, "w") as out:
        out.write(f.read() * 4)  # ~8 MB: a few seconds of tokenizing
    cache_dir = tmp_path / "cache"
    builder = start_forked(RANK, ["pretrain", path, cache_dir, 0, 1, 2])
    try:
        deadline = time.time() + 60
        while len(workers := children(builder.pid)) < 2:  # the lock is taken and both workers tokenize
            assert time.time() < deadline and builder.poll() is None, "the build never started"
            time.sleep(0.02)
    finally:
        builder.kill()
        builder.wait()
    deadline = time.time() + 30  # orphaned workers see their pipe close: they end after their task (~1 MB)
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "the killed builder's workers live on"
    assert not any(os.path.exists(cache_dir / n / "meta.json") for n in os.listdir(cache_dir))  # no cache yet
    ds = PretrainDataset(path, tokenizer, max_length=16, cache_dir=cache_dir, num_proc=2)  # takes the dead lock over
    expected = cache_bytes(reference("pretrain", path, tokenizer, str(tmp_path / "ref")).cache_path)
    assert cache_bytes(ds.cache_path) == expected
    assert sorted(os.listdir(cache_dir)) == [os.path.basename(ds.cache_path)]


def encode_dying_on_die(records, bad_lines):
    """An encode whose worker is killed (as the OOM killer would) on the record "die"."""
    for _, text, _ in records:
        if text == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        yield [([1, 2, 3], None)]


def test_a_killed_worker_stops_the_build_with_its_exit_code(tmp_path):
    path = str(tmp_path / "d.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": "die" if i == 150 else "ok"}) + "\n" for i in range(200))
    before = set(children(os.getpid()))
    out_dir = str(tmp_path / "c" / "cache")
    with pytest.raises(RuntimeError, match=r"a tokenizer worker process died \(exit code -9\)"):
        build_token_cache(out_dir, path, "text", encode_dying_on_die, np.uint16, num_proc=2)
    assert set(children(os.getpid())) <= before  # the other worker is stopped and reaped
    assert not os.path.exists(out_dir) and os.path.exists(out_dir + ".error")  # other ranks read why


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """(path, reference cache bytes) of a corpus that takes well over 10 s to tokenize here."""
    tmp_path = tmp_path_factory.mktemp("big")
    source = demo_slice(tmp_path, "pretrain", 5000)
    path = str(tmp_path / "big.jsonl")
    with open(source) as f, open(path, "w") as out:
        out.write(f.read() * BIG_REPEAT)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    return path, cache_bytes(reference("pretrain", path, tokenizer, str(tmp_path / "ref")).cache_path)


def children(pid):
    """PIDs of the live processes whose parent is `pid` (from /proc)."""
    kids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            kids.append(int(entry))
    return kids


def alive(pid):
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_build_and_its_workers_and_the_next_run_builds_it(tokenizer, tmp_path, big_corpus, sig):
    path, expected = big_corpus
    cache_dir = tmp_path / "cache"
    log = tmp_path / "builder.log"
    builder = start_forked(RANK, ["pretrain", path, cache_dir, 0, 1, 2], str(log))
    try:
        deadline = time.time() + 60
        while len(workers := children(builder.pid)) < 2:  # the lock is taken and both workers tokenize
            assert time.time() < deadline and builder.poll() is None, "the build never started"
            time.sleep(0.05)
        time.sleep(1)
        lock = [n for n in os.listdir(cache_dir) if n.endswith(".lock")]
        assert lock and builder.poll() is None, "the build ended before the signal"
        sent = time.monotonic()
        builder.send_signal(sig)
        while "error:" not in log.read_text() and builder.poll() is None:
            time.sleep(0.01)
        stopped_in = time.monotonic() - sent  # the build stopped and said so
        builder.wait(timeout=30)
        exited_in = time.monotonic() - sent
        out = log.read_text()
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
    cache_path = cache_dir / lock[0][:-len(".lock")]
    # the build stops in ~0.1 s; the process's exit (torch, transformers loaded) adds up to 1.5 s idle, ~4 s here busy
    assert stopped_in < 3 and exited_in < 15, (stopped_in, exited_in)
    assert builder.returncode == 128 + sig, out
    said = [line for line in out.splitlines() if line.strip() and not line.startswith("tokenizing ")]  # tqdm's bar
    assert said[0] == (f"error: {sig.name} while building the token cache {cache_path}: "
                       "stopped, nothing of it kept; the next run builds it"), out
    assert sum(line.startswith("error:") for line in said) == 1, out
    time.sleep(0.5)  # SIGTERM'd workers need a moment to be gone
    assert [pid for pid in workers if alive(pid)] == []
    assert sorted(os.listdir(cache_dir)) == [cache_path.name + ".error"]  # no lock, no parts, no temporary, no cache
    if sig != signal.SIGINT:
        return  # the next run meets the same files after either signal (an earlier build's .error it removes): once
    ds = PretrainDataset(path, tokenizer, max_length=16, cache_dir=cache_dir, num_proc=2)
    assert cache_bytes(ds.cache_path) == expected
    assert sorted(os.listdir(cache_dir)) == [cache_path.name]


def test_bad_arguments(tokenizer, tmp_path):
    path = demo_slice(tmp_path, "pretrain", 10)
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        PretrainDataset(path, tokenizer, cache_dir=tmp_path / "c", num_proc=0)
    with pytest.raises(ValueError, match="local_rank < size"):
        PretrainDataset(path, tokenizer, cache_dir=tmp_path / "c", part=(2, 2))
    assert token_cache.default_num_proc() == len(os.sched_getaffinity(0))


def test_pretokenize_num_proc_writes_the_cache_bytes(tokenizer, tmp_path):
    path = demo_slice(tmp_path, "pretrain", 200)
    expected = cache_bytes(reference("pretrain", path, tokenizer, str(tmp_path / "ref")).cache_path)
    run = lambda *args: forked("scripts/pretokenize.py", ["--data_path", path, "--out_dir",  # noqa: E731
                                                          str(tmp_path / "shard"), *args], timeout=120)
    assert run("--num_proc", "2").returncode == 0
    shard = os.path.join(tmp_path, "shard", "pretrain_200")
    assert open(shard + ".bin", "rb").read() == expected["tokens.bin"]
    assert open(shard + ".idx", "rb").read() == expected["offsets.bin"]
    bad = run("--num_proc", "0")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --num_proc must be at least 1, got 0"
    bad = run("--tokenizer_path", str(tmp_path))  # a folder, but no tokenizer in it: one line, not HF's traceback
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"error: --tokenizer_path {tmp_path} has no tokenizer.json or tokenizer_config.json; pass a Hugging Face "
        "tokenizer folder")


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
