"""Small real filesystems for full-disk tests: a tmpfs mount (the small_disk fixture in conftest.py), filling it."""
import os

import pytest


def no_small_disk(reason):
    """Skip a full-disk test where no tmpfs can be mounted; in CI fail instead, so that they never skip unseen."""
    message = f"needs a real small filesystem; mount -t tmpfs is not permitted: {reason}"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{message}. CI must run the full-disk tests: run as root or give the container CAP_SYS_ADMIN "
                    "(docker run --cap-add SYS_ADMIN)", pytrace=False)
    pytest.skip(message)


def fill(disk, leave=0):
    """Write a file on `disk` until it is full (what a run meets when another process fills its disk), then give
    back `leave` bytes (tmpfs frees the pages of a truncated file)."""
    path = os.path.join(disk, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(path, max(0, os.path.getsize(path) - leave))
    return path
