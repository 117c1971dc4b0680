"""Which tokenizer to use with recorded weights (model/provenance.py's record) and the tokenizer flags the user typed:
--tokenizer_path must be the recorded tokenizer unless --force_tokenizer 1; without it, the recorded folder, else
the repository's model/ when its tokenizer.json is the recorded one; and the check that a tokenizer folder holds one."""
import os

from model.errors import ConfigError
from model.provenance import short, tokenizer_sha256


class TokenizerMismatch(ValueError):
    """A tokenizer that is not the one the weights were trained with: the message is one line saying what to pass."""


def tokenizer_for(record, typed, default, what, force=False):
    """(folder, note or None): the tokenizer to use with weights whose record is `record` ({"path", "sha256"} or None).

    typed: the folder the user passed, or None; default: the repository's model/; what: the weights as the user named
    them, for the messages (e.g. "--from_weight out/x.pth"). A typed folder must hold the recorded tokenizer.json
    (force: use it anyway, with a note); without one, the recorded folder, else `default` when its hash matches.
    """
    path, sha = (record or {}).get("path"), (record or {}).get("sha256")
    if typed:
        got = tokenizer_sha256(typed)
        if sha is None or got == sha:
            return typed, None
        if not force:
            raise TokenizerMismatch(
                f"--tokenizer_path {typed} (tokenizer.json sha256 {short(got)}) is not the tokenizer {what} was "
                f"trained with ({path}, sha256 {short(sha)}); leave --tokenizer_path out to use that one, or pass "
                "--force_tokenizer 1 to use this one anyway")
        return typed, (f"--force_tokenizer 1: using {typed}, not the tokenizer {what} was trained with "
                       f"({path}, sha256 {short(sha)})")
    if path is None:
        return default, f"{what} records no tokenizer; using {default} (--tokenizer_path if the run used another)"
    for folder in [path] + ([default] if sha else []):
        if os.path.isdir(folder) and (sha is None or tokenizer_sha256(folder) == sha):
            same = os.path.realpath(folder) == os.path.realpath(default)
            return folder, None if same else f"{what} was trained with the tokenizer {folder}: using it"
    state = "has changed" if os.path.isdir(path) else "is not found here"
    raise TokenizerMismatch(f"{what} was trained with the tokenizer {path} (tokenizer.json sha256 {short(sha)}), which "
                            f"{state}; pass --tokenizer_path with that tokenizer's folder")


def check_tokenizer(path):
    """A Hugging Face tokenizer folder: a directory with tokenizer.json or tokenizer_config.json."""
    if not os.path.isdir(path):
        raise ConfigError(f"--tokenizer_path {path} is not a directory; pass the folder with tokenizer.json "
                          "(default: model/ in the repo)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"--tokenizer_path {path} has no tokenizer.json or tokenizer_config.json; "
                          "pass a Hugging Face tokenizer folder")
