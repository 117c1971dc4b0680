"""The one atomic writer: every file the trainer writes (weights, sidecars, checkpoints' own files, indexes, caches of
measurements) is either the old one or the new one, never half of it, and a failed write (a full disk) leaves nothing.
"""
import errno
import json
import os
import shutil
from contextlib import contextmanager


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
    import torch  # here, not at the top: curation's workers import this writer and need no torch (issue 55)

    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path, text):
    """Write `text` (UTF-8) to `path` atomically: an index or config file is either the old one or the new one."""
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_json(obj, path):
    """`obj` as indented JSON at `path`, atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True).encode()))


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, quota, file size limit (RLIMIT_FSIZE)
FULL_WORDS = ("os error 28", "os error 122", "os error 27")  # the same, as safetensors' Rust writer words them


def full_disk_reason(exc):
    """Why `exc` means a full disk ("No space left on device", ...), or None: an OSError of FULL_ERRNOS in its chain,
    or safetensors' SafetensorError, which carries the OS error only in its text."""
    seen, visited = exc, set()
    while seen is not None and id(seen) not in visited:  # `raise a from b` can close a loop
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return seen.strerror
        words = [w for w in FULL_WORDS if w in str(seen)]
        if words:
            return os.strerror(int(words[0].split()[-1]))
        seen = seen.__cause__ or seen.__context__
    return None


def current_umask():
    """The process's umask (os.umask can only be read by setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model")  # an HF folder's weight files and index


@contextmanager
def files_replaced_in(folder, last="config.json"):
    """Yield a temporary folder beside `folder` to write a model folder's files into; when the block ends they replace
    the files of the same names in `folder` one by one (each os.replace whole, each file fsynced first), `last`
    removed first and put in place last: a folder cut off in between has no `last`, so it never loads as a mix of two
    exports. An earlier export's weight files that this one does not write go; other files of `folder` stay. A block
    that fails (a full disk) leaves `folder` as it was and no temporary folder."""
    tmp = f"{os.path.abspath(folder)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        names = sorted(os.listdir(tmp), key=lambda name: name == last)  # `last` at the end
        mode = 0o666 & ~current_umask()
        for name in names:
            if os.path.isfile(os.path.join(tmp, name)):
                # a writer's own temp file (transformers' safetensors) is 0600: exported files get the user's umask
                os.chmod(os.path.join(tmp, name), mode)
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
        os.makedirs(folder, exist_ok=True)
        stale = [n for n in os.listdir(folder) if n == last or (n.startswith(WEIGHT_FILE_PREFIXES) and n not in names)]
        for name in sorted(stale, key=lambda n: n != last):  # `last` first: the folder stops loading before it changes
            os.remove(os.path.join(folder, name))
        for name in names:
            target = os.path.join(folder, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(os.path.join(tmp, name), target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
