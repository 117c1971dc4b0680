"""The token cache's worker processes: each tokenizes ranges of a file (dataset/tokenizing/file_ranges.py) with the
dataset's encode function and returns token bytes, document lengths, the loss mask and the bad-line count, in file
order.
"""
import multiprocessing
import multiprocessing.connection
import os
import signal

import numpy as np

from dataset.tokenizing.file_ranges import BadLines, iter_records

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


def tokenized_ranges(task, ranges, num_proc):
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
