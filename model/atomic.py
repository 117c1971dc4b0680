"""The one atomic writer: every file the trainer writes (weights, sidecars, checkpoints' own files, indexes, caches of
measurements) is either the old one or the new one, never half of it, and a failed write (a full disk) leaves nothing.
"""
import json
import os
import shutil
from contextlib import contextmanager

import torch


def atomic_write(path, write):
    """write(file) into a temporary file, fsync, then rename: a killed save never leaves a valid-looking file, and a
    failed one (a full disk) leaves neither the temporary file nor a changed `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def atomic_folder(path):
    """Yield a temporary folder beside `path` to write into; when the block ends it takes the place of `path`, and a
    block that fails (a full disk) leaves neither the temporary folder nor a changed `path`."""
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(path):
            os.rename(old, path)  # the rename in between failed: the previous folder comes back
        raise
    shutil.rmtree(old, ignore_errors=True)


def atomic_save(obj, path):
    """torch.save `obj` to `path` atomically (temporary file, fsync, rename)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path, text):
    """Write `text` (UTF-8) to `path` atomically: an index or config file is either the old one or the new one."""
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_json(obj, path):
    """`obj` as indented JSON at `path`, atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True).encode()))
