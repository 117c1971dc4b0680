"""The on-disk token cache's build, once per node and in parallel (dataset/shards.py imports this module on a cache
miss; reading a complete cache, and its checks, are dataset/cache_guard.py's).

A cache directory holds tokens.bin (uint16/uint32), offsets.bin (int64, num_docs + 1), mask.bin (uint8, SFT
only) and meta.json, written last: a cache is complete exactly when its meta.json exists.

Building it goes through files only, so no collective (and no --dist_timeout) is involved:
- local rank 0 of one node takes `<cache>.lock` (O_EXCL; holds its node, host, pid and number of parts) and
  touches it while it works; a lock whose holder died (same host: pid gone; other host: not touched for
  STALE_LOCK_S) is taken over;
- each local rank r of the lock's node tokenizes part r of the file (byte ranges aligned to line starts;
  parquet: row groups) with `num_proc` worker processes into `<cache>.parts<n>/part<r>`;
- the lock holder joins the parts in file order into `<cache>.tmp<pid>` and renames it to `<cache>`: the same
  bytes one process writes;
- a rank that fails (a bad line, say) writes its one-line message to `<cache>.error`; the others read it and
  stop with the same line instead of waiting for the timeout;
- SIGINT/SIGTERM stop the build at once (CacheBuildInterrupted): workers are terminated, temporary files, the
  parts and the lock removed; the next run builds the cache from the start.
A part's ranges and records: dataset/tokenizing/file_ranges.py; its worker processes:
dataset/tokenizing/tokenize_pool.py.
"""
import json
import math
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
from tqdm import tqdm

from dataset.cache_guard import (
    CACHE_FORMAT_VERSION,
    CacheBuildInterrupted,
    cache_header,
    discard_if_damaged,
    disk_full_line,
)
from dataset.tokenizing.file_ranges import extent, is_parquet, split_range
from dataset.tokenizing.tokenize_pool import tokenized_ranges

TASK_BYTES = 4 << 20  # JSONL bytes per worker task: many tasks keep workers busy, each stays small in memory
POLL_S = 0.1  # how often waiting ranks look for the cache, its error file and the lock
HEARTBEAT_S = 5  # how often the lock holder touches the lock
STALE_LOCK_S = 60  # a lock from another host not touched for this long belongs to a dead builder
WAIT_TIMEOUT_S = 6 * 3600  # longest wait for another rank's part or another node's cache


def default_num_proc():
    """Worker processes to tokenize with: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_node():
    """Identity of this node: its host name and torchrun's node rank (two launches on one host differ)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"


def _write_part(part_dir, task, part_range, num_proc, heartbeat, show=False):
    """Tokenize `part_range` into part_dir/{tokens,mask,lengths}.bin + meta.json, atomically; `show`: a progress bar
    (with ETA) over its bytes (row groups for parquet) once the build takes more than a second."""
    data_path = task[0]
    start, end = part_range
    pieces = max(1, min(end - start, max(4 * num_proc, math.ceil((end - start) / TASK_BYTES))))
    if is_parquet(data_path):
        pieces = max(1, end - start)  # one row group per task
    ranges = [r for r in split_range(data_path, start, end, pieces) if r[0] < r[1]] or [(start, start)]
    tmp_dir = f"{part_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    num_docs = num_tokens = num_bad = 0
    has_mask = False
    results = tokenized_ranges(task, ranges, num_proc)
    parquet = is_parquet(data_path)
    bar = tqdm(total=end - start, desc=f"tokenizing {os.path.basename(data_path)}", unit=" row groups" if parquet
               else "B", unit_scale=not parquet, disable=not show, delay=1, mininterval=1, dynamic_ncols=True)
    try:
        with open(os.path.join(tmp_dir, "tokens.bin"), "wb") as f_tokens, \
                open(os.path.join(tmp_dir, "mask.bin"), "wb") as f_mask, \
                open(os.path.join(tmp_dir, "lengths.bin"), "wb") as f_lengths:
            for (range_start, range_end), (token_bytes, lengths, mask_bytes, bad) in zip(ranges, results):
                bar.update(range_end - range_start)
                f_tokens.write(token_bytes)
                f_lengths.write(lengths.tobytes())
                if mask_bytes is not None:
                    has_mask = True
                    f_mask.write(mask_bytes)
                num_docs, num_tokens, num_bad = num_docs + len(lengths), num_tokens + int(lengths.sum()), num_bad + bad
                heartbeat()
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump({"num_docs": num_docs, "num_tokens": num_tokens, "num_bad_lines": num_bad,
                       "has_mask": has_mask}, f)
        _rename_or_discard(tmp_dir, part_dir)
    except BaseException:
        results.close()  # runs the generator's finally now: its workers are terminated before the files go
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        bar.close()


def _rename_or_discard(tmp_dir, final_dir):
    try:
        os.rename(tmp_dir, final_dir)  # atomic: readers see nothing or the whole directory
    except OSError:
        if not os.path.exists(os.path.join(final_dir, "meta.json")):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)  # another process finished the same directory first


def _join_parts(out_dir, parts_dir, num_parts, data_path, token_dtype, format_version=CACHE_FORMAT_VERSION):
    """Concatenate the parts in file order into the cache `out_dir`, atomically."""
    part_dirs = [os.path.join(parts_dir, f"part{r}") for r in range(num_parts)]
    metas = [json.load(open(os.path.join(d, "meta.json"))) for d in part_dirs]
    num_docs, num_bad = sum(m["num_docs"] for m in metas), sum(m["num_bad_lines"] for m in metas)
    if num_docs == 0:
        raise ValueError(f"{data_path}: no samples" + (f" ({num_bad} bad lines skipped)" if num_bad else ""))
    tmp_dir = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        for name in ("tokens", "mask"):
            with open(os.path.join(tmp_dir, f"{name}.bin"), "wb") as out:
                for d in part_dirs:
                    with open(os.path.join(d, f"{name}.bin"), "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
        if not any(m["has_mask"] for m in metas):
            os.remove(os.path.join(tmp_dir, "mask.bin"))
        with open(os.path.join(tmp_dir, "offsets.bin"), "wb") as out:
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            base = 0
            for d in part_dirs:
                offsets = base + np.cumsum(np.fromfile(os.path.join(d, "lengths.bin"), dtype=np.int64))
                out.write(offsets.tobytes())
                base = int(offsets[-1]) if len(offsets) else base
        meta = {"source": os.path.abspath(data_path), "num_docs": num_docs, "num_tokens": base,
                "token_dtype": np.dtype(token_dtype).name, "num_bad_lines": num_bad,
                "format_version": format_version, **cache_header(tmp_dir)}  # sizes and checksum, checked on open
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _rename_or_discard(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(parts_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- the lock and the signals

def _read_json(path):
    """The JSON in `path`; None if absent; {} while it is being written."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_is_stale(lock_path, holder):
    """Whether the builder that holds the lock is gone (this process holds no lock it is not using)."""
    if holder.get("host") == socket.gethostname() and "pid" in holder:
        return holder["pid"] == os.getpid() or not _pid_alive(holder["pid"])
    try:
        return time.time() - os.stat(lock_path).st_mtime > STALE_LOCK_S
    except FileNotFoundError:
        return False


def _try_lock(lock_path, me):
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return True


def _write_error(error_path, message):
    tmp = f"{error_path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(message)
        os.replace(tmp, error_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)  # a full disk took no error file either


@contextmanager
def _interrupted_by_signals(out_dir):
    """Within the block, the first SIGINT/SIGTERM raises CacheBuildInterrupted; later ones are ignored (cleanup)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread only
        yield
        return
    raised = []

    def handle(signum, frame):
        if not raised:
            raised.append(signum)
            raise CacheBuildInterrupted(f"{signal.Signals(signum).name} while building the token cache {out_dir}: "
                                        "stopped, nothing of it kept; the next run builds it", signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_token_cache(out_dir, data_path, field, encode, token_dtype, skip_bad_lines=False, num_proc=None,
                      part=(0, 1), node=None, wait_timeout=WAIT_TIMEOUT_S, format_version=CACHE_FORMAT_VERSION):
    """Make sure the complete cache `out_dir` of `data_path` exists; return whether this process tokenized.

    encode(records, bad_lines) yields chunks of (ids, mask or None) from iter_records' (lineno, value, error)
    and must be a module-level function or bound method (worker processes call it). part=(local_rank,
    local_world_size): call it on every local rank with the same arguments. num_proc: worker processes per
    rank (default: the cores available / local_world_size). node: who counts as the same node (default: default_node()).
    format_version: what its meta.json records (dataset/cache_guard.py: format_version of the rows' kind).
    """
    rank, num_parts = part
    if num_proc is None:  # the node's cores, shared by its local ranks
        num_proc = max(1, default_num_proc() // num_parts) if isinstance(num_parts, int) and num_parts > 0 else 1
    if not (isinstance(num_proc, int) and num_proc >= 1):
        raise ValueError(f"num_proc must be a positive integer, got {num_proc}")
    if not (isinstance(rank, int) and isinstance(num_parts, int) and 0 <= rank < num_parts):
        raise ValueError(f"part must be (local_rank, local_world_size) with 0 <= local_rank < size, got {part}")
    if discard_if_damaged(out_dir, quiet=rank != 0):  # a damaged one is built again
        return False
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    me = {"node": node or default_node(), "host": socket.gethostname(), "pid": os.getpid(), "parts": num_parts,
          "since": time.time()}
    task = (data_path, field, encode, token_dtype, skip_bad_lines)
    return _Build(out_dir, task, part, num_proc, me, wait_timeout, format_version).run()


class _Build:
    """One rank's share of building the cache `out_dir`: the lock it may hold (rank 0), its heartbeat, its part, the
    wait's deadline."""

    def __init__(self, out_dir, task, part, num_proc, me, wait_timeout, format_version=CACHE_FORMAT_VERSION):
        self.out_dir, self.task, (self.rank, self.num_parts), self.num_proc, self.me = out_dir, task, part, num_proc, me
        self.format_version = format_version  # what meta.json records: the kind's (cache_guard.format_version)
        self.wait_timeout, self.meta_path = wait_timeout, os.path.join(out_dir, "meta.json")
        self.lock_path, self.error_path = f"{out_dir}.lock", f"{out_dir}.error"
        self.parts_dir = f"{out_dir}.parts{self.num_parts}"
        self.part_dir = os.path.join(self.parts_dir, f"part{self.rank}")
        self.holding = self.tokenized = False
        self.last_beat = time.monotonic()
        self.deadline = self.last_beat + wait_timeout

    def heartbeat(self):
        if self.holding and time.monotonic() - self.last_beat > HEARTBEAT_S:
            try:
                os.utime(self.lock_path)
            except FileNotFoundError:
                pass  # taken over by someone who thought it stale: both finish the same bytes
            self.last_beat = time.monotonic()

    def run(self):
        """Build or wait until the cache is complete; whether this process tokenized."""
        with _interrupted_by_signals(self.out_dir):
            try:
                while not os.path.exists(self.meta_path):
                    self.step()
            except _ReportedError as e:
                raise ValueError(str(e)) from None
            except CacheBuildInterrupted as e:
                _abandon(str(e), self.error_path, self.lock_path if self.holding else None,
                         self.parts_dir if self.holding else None)
                raise
            except Exception as e:
                full = self.fail(e)
                if full:
                    raise ValueError(full) from None
                raise
            if self.holding:
                os.remove(self.lock_path)
        return self.tokenized

    def step(self):
        """One look at the build: take a free or stale lock, tokenize this rank's part, join the parts, or wait."""
        rank, num_parts, data_path = self.rank, self.num_parts, self.task[0]
        holder = _read_json(self.lock_path)
        if holder and _lock_is_stale(self.lock_path, holder) and not self.holding:
            holder = None  # its builder died: its error and its lock no longer count
            if rank == 0:
                try:
                    os.remove(self.lock_path)
                except FileNotFoundError:
                    pass
        if holder is None and rank == 0 and _try_lock(self.lock_path, self.me):
            self.holding, holder = True, self.me
            if os.path.exists(self.error_path):
                os.remove(self.error_path)  # an earlier failed build's: this build tries again
        since = (holder or self.me).get("since", 0)  # an error file older than this build's start is a past one's
        if os.path.exists(self.error_path) and os.stat(self.error_path).st_mtime >= since - 1:
            with open(self.error_path) as f:
                raise _ReportedError(f.read())
        ours = bool(holder) and holder.get("node") == self.me["node"] and holder.get("parts") == num_parts
        if ours and not os.path.exists(os.path.join(self.part_dir, "meta.json")):
            _write_part(self.part_dir, self.task, split_range(data_path, *extent(data_path), num_parts)[rank],
                        self.num_proc, self.heartbeat, show=rank == 0)
            self.tokenized = True
        elif self.holding and all(os.path.exists(os.path.join(self.parts_dir, f"part{r}", "meta.json"))
                                  for r in range(num_parts)):
            _join_parts(self.out_dir, self.parts_dir, num_parts, data_path, self.task[3], self.format_version)
        elif time.monotonic() > self.deadline:
            raise TimeoutError(f"waited {self.wait_timeout:.0f}s for the token cache {self.out_dir} (lock: {holder}); "
                               f"if no build is running, remove {self.lock_path}")
        else:
            self.heartbeat()
            time.sleep(POLL_S)

    def fail(self, e):
        """After an error: a full disk frees what the build wrote; the other ranks are told (an error file); the
        full-disk line, or None."""
        full = disk_full_line(e, self.out_dir)
        if full and self.holding:  # what the build wrote goes, so the space it took is free again
            shutil.rmtree(self.parts_dir, ignore_errors=True)
            os.remove(self.lock_path)
        if not isinstance(e, TimeoutError):  # tell the other ranks, so they stop with this line, not a timeout
            try:
                _write_error(self.error_path, full or (str(e) if isinstance(e, ValueError) else
                                                       f"{type(e).__name__}: {e}"))
            except OSError:
                pass  # a full disk takes no error file either: the other ranks meet it themselves
        return full


def _abandon(message, error_path, lock_path, parts_dir):
    """After a signal: tell the other ranks; the lock holder drops the parts and the lock (the cache starts over)."""
    _write_error(error_path, message)
    if parts_dir is not None:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if lock_path is not None and os.path.exists(lock_path):
        os.remove(lock_path)


class _ReportedError(Exception):
    """Another rank's error, read from the error file."""
