"""The on-disk token cache, built once per node and in parallel.

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
"""
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
from tqdm import tqdm

from dataset.cache_guard import cache_header, discard_if_damaged, disk_full_line

CACHE_FORMAT_VERSION = 2  # 2: SFT labels cover think blocks and tool calls; tools rendered
TASK_BYTES = 4 << 20  # JSONL bytes per worker task: many tasks keep workers busy, each stays small in memory
POLL_S = 0.1  # how often waiting ranks look for the cache, its error file and the lock
HEARTBEAT_S = 5  # how often the lock holder touches the lock
STALE_LOCK_S = 60  # a lock from another host not touched for this long belongs to a dead builder
WAIT_TIMEOUT_S = 6 * 3600  # longest wait for another rank's part or another node's cache


def default_num_proc():
    """Worker processes to tokenize with: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_part():
    """(local_rank, local_world_size) of this process under torchrun; (0, 1) otherwise."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def default_node():
    """Identity of this node: its host name and torchrun's node rank (two launches on one host differ)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"


# ----------------------------------------------------------------------------- reading ranges of a file
# A range is (start, end) in bytes for JSONL (start aligned to a line start) and in row groups for parquet.

def _is_parquet(path):
    return path.endswith(".parquet")


def _extent(path):
    if _is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        return 0, pq.ParquetFile(path).num_row_groups
    return 0, os.path.getsize(path)


def split_range(path, start, end, pieces):
    """`pieces` consecutive ranges covering [start, end), JSONL boundaries moved to the next line start."""
    cuts = [start + (end - start) * i // pieces for i in range(pieces + 1)]
    if not _is_parquet(path):
        with open(path, "rb") as f:
            for i in range(1, pieces):
                if cuts[i] > 0:
                    f.seek(cuts[i] - 1)
                    f.readline()  # to the end of the line holding byte cuts[i] - 1
                    cuts[i] = min(max(f.tell(), cuts[i - 1]), end)
    return list(zip(cuts[:-1], cuts[1:]))


def lines_before(path, start):
    """Lines (rows) of the file before `start`: turns a line number within a range into one in the file."""
    if _is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        metadata = pq.ParquetFile(path).metadata
        return sum(metadata.row_group(i).num_rows for i in range(start))
    count = 0
    with open(path, "rb") as f:
        while start > 0:
            block = f.read(min(start, 1 << 24))
            count += block.count(b"\n")
            start -= len(block)
    return count


def iter_records(path, field, start, end):
    """Yield (line or row number within the range, 1-based; value of `field`; error or None) per record."""
    if _is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        parquet_file = pq.ParquetFile(path)
        if field not in parquet_file.schema_arrow.names:
            raise ValueError(f"{path}: parquet file has no '{field}' column")
        row = 0
        if start >= end:
            return
        for batch in parquet_file.iter_batches(columns=[field], row_groups=range(start, end)):
            for value in batch.column(0).to_pylist():
                row += 1
                yield row, value, None if value is not None else f"'{field}' is null"
        return
    with open(path, "rb") as f:  # bytes, so a bad UTF-8 line is reported with its number, too
        f.seek(start)
        position, lineno = start, 0
        while position < end:
            line = f.readline()
            if not line:
                break
            position, lineno = position + len(line), lineno + 1
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) are not records
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield lineno, None, f"malformed JSON ({e})"
                continue
            if not isinstance(record, dict) or field not in record:
                yield lineno, None, f"no '{field}' field"
                continue
            yield lineno, record[field], None


class BadLines:
    """Raises `file:line: error` (line numbered in the whole file) on a bad record, or counts it when skipping."""

    def __init__(self, path, skip, start=0):
        self.path, self.skip, self.start, self.count = path, skip, start, 0

    def __call__(self, lineno, error):
        if not self.skip:
            raise ValueError(f"{self.path}:{lines_before(self.path, self.start) + lineno}: {error}")
        self.count += 1


# ----------------------------------------------------------------------------- tokenizing one part

_task = None  # (data_path, field, encode, token_dtype, skip_bad_lines), set in each worker by _init_worker


def _init_worker(task):
    global _task
    _task = task
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's terminate() ends a worker mid-task


def _tokenize_range(byte_range):
    """Tokens (bytes), document lengths, mask (bytes or None) and bad-line count of one range."""
    data_path, field, encode, token_dtype, skip = _task
    bad_lines = BadLines(data_path, skip, byte_range[0])
    tokens, lengths, masks = [], [], []
    for chunk in encode(iter_records(data_path, field, *byte_range), bad_lines):
        for ids, mask in chunk:
            tokens.append(np.asarray(ids, dtype=token_dtype))
            lengths.append(len(ids))
            if mask is not None:
                masks.append(np.asarray(mask, dtype=np.uint8))
    token_bytes = np.concatenate(tokens).tobytes() if tokens else b""
    return token_bytes, np.asarray(lengths, dtype=np.int64), np.concatenate(masks).tobytes() if masks else None, \
        bad_lines.count


def _worker(task, conn, inherited):
    """A worker process: tokenizes each range the parent sends over its own pipe until None (or the pipe closes)."""
    for other in inherited:  # the other pipe ends fork copied: closed, so that only the parent and this worker
        other.close()  # hold this pipe (each sees the other's death as EOF)
    _init_worker(task)
    try:
        while (byte_range := conn.recv()) is not None:
            try:
                result = (True, _tokenize_range(byte_range))
            except Exception as e:
                result = (False, e)
            try:
                conn.send(result)
            except Exception:  # an exception that does not pickle goes as its text
                conn.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: so is this worker


def _start_workers(task, count):
    """{parent end of its pipe: process} of `count` worker processes running _worker."""
    # fork, as DataLoader workers do: no re-import, and the tokenizer is inherited instead of pickled
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    pipes = [ctx.Pipe() for _ in range(count)]
    ends = [end for pipe in pipes for end in pipe] if method == "fork" else []
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # workers are the parallelism; silences the after-fork warning
    workers = {}
    try:
        for parent, child in pipes:
            process = ctx.Process(target=_worker, args=(task, child, [e for e in ends if e is not child]),
                                  daemon=True)
            process.start()
            workers[parent] = process
            child.close()
    finally:
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    return workers


def _tokenized_ranges(task, ranges, num_proc):
    """Results of _tokenize_range over `ranges`, in order, from `num_proc` worker processes.

    Each worker has a pipe of its own (no lock shared with the others, unlike multiprocessing.Pool, whose
    terminate() deadlocks when a worker dies holding the result queue's lock), and a worker that dies is an
    error here, not a task waited for forever.
    """
    if num_proc == 1 or len(ranges) == 1:
        _init_worker(task)
        yield from map(_tokenize_range, ranges)
        return
    workers = _start_workers(task, min(num_proc, len(ranges)))
    todo, busy, done, next_index = iter(enumerate(ranges)), {}, {}, 0

    def give(conn):
        index, byte_range = next(todo, (None, None))
        try:
            conn.send(byte_range)  # None: no more work, the worker exits
        except OSError:
            pass  # the worker died just now: the wait below reads its end (EOF) and says so
        if index is not None:
            busy[conn] = index

    try:
        for conn in workers:
            give(conn)
        while next_index < len(ranges):
            if next_index in done:  # in file order: the first bad line of the file is the one reported
                ok, value = done.pop(next_index)
                if not ok:
                    raise value
                yield value
                next_index += 1
                continue
            sentinels = {workers[conn].sentinel: conn for conn in busy}
            for ready in multiprocessing.connection.wait(list(busy) + list(sentinels)):
                conn = sentinels.get(ready, ready)
                if conn not in busy:
                    continue  # its result came with the same wait
                try:
                    done[busy[conn]] = conn.recv()
                except EOFError:  # died mid-task
                    workers[conn].join()
                    raise RuntimeError(f"a tokenizer worker process died (exit code {workers[conn].exitcode}); if "
                                       "it was killed for memory, lower --num_proc or split the file") from None
                del busy[conn]
                give(conn)
    finally:
        for conn, process in workers.items():
            if process.is_alive():
                process.terminate()
            process.join()
            conn.close()


def _write_part(part_dir, task, part_range, num_proc, heartbeat, show=False):
    """Tokenize `part_range` into part_dir/{tokens,mask,lengths}.bin + meta.json, atomically; `show`: a progress bar
    (with ETA) over its bytes (row groups for parquet) once the build takes more than a second."""
    data_path = task[0]
    start, end = part_range
    pieces = max(1, min(end - start, max(4 * num_proc, math.ceil((end - start) / TASK_BYTES))))
    if _is_parquet(data_path):
        pieces = max(1, end - start)  # one row group per task
    ranges = [r for r in split_range(data_path, start, end, pieces) if r[0] < r[1]] or [(start, start)]
    tmp_dir = f"{part_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    num_docs = num_tokens = num_bad = 0
    has_mask = False
    results = _tokenized_ranges(task, ranges, num_proc)
    parquet = _is_parquet(data_path)
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


def _join_parts(out_dir, parts_dir, num_parts, data_path, token_dtype):
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
                "format_version": CACHE_FORMAT_VERSION, **cache_header(tmp_dir)}  # sizes and checksum, checked on open
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


class CacheBuildInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the build; `signum` tells which (exit code 128 + signum)."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum


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
                      part=(0, 1), node=None, wait_timeout=WAIT_TIMEOUT_S):
    """Make sure the complete cache `out_dir` of `data_path` exists; return whether this process tokenized.

    encode(records, bad_lines) yields chunks of (ids, mask or None) from iter_records' (lineno, value, error)
    and must be a module-level function or bound method (worker processes call it). part=(local_rank,
    local_world_size): call it on every local rank with the same arguments. num_proc: worker processes per
    rank (default: the cores available / local_world_size). node: who counts as the same node (default: default_node()).
    """
    rank, num_parts = part
    if num_proc is None:  # the node's cores, shared by its local ranks
        num_proc = max(1, default_num_proc() // num_parts) if isinstance(num_parts, int) and num_parts > 0 else 1
    if not (isinstance(num_proc, int) and num_proc >= 1):
        raise ValueError(f"num_proc must be a positive integer, got {num_proc}")
    if not (isinstance(rank, int) and isinstance(num_parts, int) and 0 <= rank < num_parts):
        raise ValueError(f"part must be (local_rank, local_world_size) with 0 <= local_rank < size, got {part}")
    meta_path = os.path.join(out_dir, "meta.json")
    if discard_if_damaged(out_dir, quiet=rank != 0):  # a damaged one is built again
        return False
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    lock_path, error_path, parts_dir = f"{out_dir}.lock", f"{out_dir}.error", f"{out_dir}.parts{num_parts}"
    part_dir = os.path.join(parts_dir, f"part{rank}")
    me = {"node": node or default_node(), "host": socket.gethostname(), "pid": os.getpid(), "parts": num_parts,
          "since": time.time()}
    task = (data_path, field, encode, token_dtype, skip_bad_lines)
    holding = tokenized = False
    last_beat, deadline = time.monotonic(), time.monotonic() + wait_timeout

    def heartbeat():
        nonlocal last_beat
        if holding and time.monotonic() - last_beat > HEARTBEAT_S:
            try:
                os.utime(lock_path)
            except FileNotFoundError:
                pass  # taken over by someone who thought it stale: both finish the same bytes
            last_beat = time.monotonic()

    with _interrupted_by_signals(out_dir):
        try:
            while not os.path.exists(meta_path):
                holder = _read_json(lock_path)
                if holder and _lock_is_stale(lock_path, holder) and not holding:
                    holder = None  # its builder died: its error and its lock no longer count
                    if rank == 0:
                        try:
                            os.remove(lock_path)
                        except FileNotFoundError:
                            pass
                if holder is None and rank == 0 and _try_lock(lock_path, me):
                    holding, holder = True, me
                    if os.path.exists(error_path):
                        os.remove(error_path)  # an earlier failed build's: this build tries again
                since = (holder or me).get("since", 0)  # an error file older than this build's start is a past one's
                if os.path.exists(error_path) and os.stat(error_path).st_mtime >= since - 1:
                    with open(error_path) as f:
                        raise _ReportedError(f.read())
                ours = bool(holder) and holder.get("node") == me["node"] and holder.get("parts") == num_parts
                if ours and not os.path.exists(os.path.join(part_dir, "meta.json")):
                    _write_part(part_dir, task, split_range(data_path, *_extent(data_path), num_parts)[rank],
                                num_proc, heartbeat, show=rank == 0)
                    tokenized = True
                elif holding and all(os.path.exists(os.path.join(parts_dir, f"part{r}", "meta.json"))
                                     for r in range(num_parts)):
                    _join_parts(out_dir, parts_dir, num_parts, data_path, token_dtype)
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"waited {wait_timeout:.0f}s for the token cache {out_dir} (lock: {holder}); "
                                       f"if no build is running, remove {lock_path}")
                else:
                    heartbeat()
                    time.sleep(POLL_S)
        except _ReportedError as e:
            raise ValueError(str(e)) from None
        except CacheBuildInterrupted as e:
            _abandon(str(e), error_path, lock_path if holding else None, parts_dir if holding else None)
            raise
        except Exception as e:
            full = disk_full_line(e, out_dir)
            if full and holding:  # what the build wrote goes, so the space it took is free again
                shutil.rmtree(parts_dir, ignore_errors=True)
                os.remove(lock_path)
            if not isinstance(e, TimeoutError):  # tell the other ranks, so they stop with this line, not a timeout
                try:
                    _write_error(error_path, full or (str(e) if isinstance(e, ValueError) else
                                                      f"{type(e).__name__}: {e}"))
                except OSError:
                    pass  # a full disk takes no error file either: the other ranks meet it themselves
            if full:
                raise ValueError(full) from None
            raise
        if holding:
            os.remove(lock_path)
    return tokenized


def _abandon(message, error_path, lock_path, parts_dir):
    """After a signal: tell the other ranks; the lock holder drops the parts and the lock (the cache starts over)."""
    _write_error(error_path, message)
    if parts_dir is not None:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if lock_path is not None and os.path.exists(lock_path):
        os.remove(lock_path)


class _ReportedError(Exception):
    """Another rank's error, read from the error file."""
