"""The path rule and the names of files: the repository root, where a typed or default path resolves, MiniMind's
weight file stem, a weights file's digest."""
import hashlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_path(path):
    """A path relative to the repository root (absolute paths pass through): where defaults live."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def typed_or_default(typed, default):
    """The path rule: a path the user typed resolves against the current directory, a default against the repo."""
    if typed is None:
        return None if default is None else repo_path(default)
    return os.path.abspath(typed)


def weight_name(save_weight, config):
    """MiniMind's weight file stem: <save_weight>_<hidden>[_moe]."""
    return f"{save_weight}_{config.hidden_size}{'_moe' if config.use_moe else ''}"


def file_digest(path):
    """' (sha256 <first 12 hex>)' of a weights file, so a run's log names the exact bytes it started from; '' for a
    folder (an HF folder, a checkpoint directory)."""
    if not os.path.isfile(path):
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return f" (sha256 {digest.hexdigest()[:12]})"
