"""MiniMind's weight file names (<prefix>_<hidden>[_moe].pth) and the path rule (typed paths follow the current
directory, defaults the repository): what the trainer and the inference library (scripts/inference/) both resolve."""
import hashlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model/weights/ -> the repository


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


def weight_path(spec, save_dir, config):
    """A weights flag as a path: "none", a .pth or a folder as typed, else a weight prefix in save_dir,
    <save_dir>/<prefix>_<hidden>[_moe].pth, MiniMind's names (--from_weight, DPO's --ref_weight)."""
    if spec == "none":
        return "none"
    if spec.endswith(".pth") or os.path.isdir(spec):
        return typed_or_default(spec, None)
    return os.path.join(save_dir, weight_name(spec, config) + ".pth")


def other_sizes(path, flag):
    """For a missing MiniMind weight <prefix>_<hidden>[_moe].pth, the files of the same prefix and other sizes beside
    it and how to use them ("<folder> has x_256.pth (--hidden_size 256): pass its size flags or <flag> <file>; "),
    else ""."""
    match = re.fullmatch(r"(.+)_\d+(_moe)?\.pth", os.path.basename(path))
    folder = os.path.dirname(path)
    if not match or not os.path.isdir(folder):
        return ""
    pattern = re.escape(match.group(1)) + r"_(\d+)(_moe)?\.pth"
    found = [re.fullmatch(pattern, name) for name in sorted(os.listdir(folder))]
    found = [(m.group(0), f"--hidden_size {m.group(1)}{' --use_moe 1' if m.group(2) else ''}") for m in found if m]
    if not found:
        return ""
    files = ", ".join(f"{name} ({flags})" for name, flags in found)
    return f"{folder} has {files}: pass its size flags or {flag} {os.path.join(folder, found[0][0])}; "


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
