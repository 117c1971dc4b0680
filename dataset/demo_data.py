"""
Embedded default corpora, built from text that ships with the installed software (no download).

- pretrain_demo.jsonl  {"text": ...}: Python's own documentation (pydoc topics + standard-library
  docstrings, read with `ast`, nothing imported) mixed with chatterbot-corpus dialogues.
- sft_demo.jsonl       {"conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}:
  chatterbot-corpus English and Chinese dialogues.

Both are a pure function of the installed Python and packages: same bytes on every such machine.
Run `python dataset/demo_data.py` to build both, or call `ensure_demo_data("pretrain" | "sft")`.
"""
import ast
import json
import os
import random
import sysconfig
import warnings

DATASET_DIR = os.path.dirname(os.path.abspath(__file__))
PRETRAIN_DEMO = os.path.join(DATASET_DIR, "pretrain_demo.jsonl")
SFT_DEMO = os.path.join(DATASET_DIR, "sft_demo.jsonl")
DEMO_FILES = {"pretrain": "pretrain_demo.jsonl", "sft": "sft_demo.jsonl"}

CHATTERBOT_LANGUAGES = ("english", "chinese")
MIN_DOCSTRING_CHARS = 200   # shorter docstrings are mostly one-line signatures, not prose
MAX_CHUNK_CHARS = 2000      # pydoc topics are cut into paragraph chunks of at most about this size
# stdlib folders that hold tests, third-party code, GUIs demos or binaries rather than documentation
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
             "__pycache__", "lib-dynload", "pydoc_data", "ensurepip"}


def _chunk_paragraphs(text, max_chars=MAX_CHUNK_CHARS, min_chars=MIN_DOCSTRING_CHARS):
    """Greedily join blank-line separated paragraphs into chunks of at most ~max_chars."""
    chunks, current = [], ""
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        if current and len(current) + 2 + len(para) > max_chars and len(current) >= min_chars:
            chunks.append(current)
            current = para
        else:
            current = current + "\n\n" + para if current else para
    if current.strip():
        chunks.append(current)
    return chunks


def pydoc_topic_texts():
    """Python's help() topics (the language reference as plain text), chunked by paragraphs."""
    from pydoc_data.topics import topics
    texts = []
    for name in sorted(topics):
        texts.extend(_chunk_paragraphs(topics[name].strip()))
    return texts


def stdlib_docstrings(stdlib_dir=None, min_chars=MIN_DOCSTRING_CHARS):
    """Module/class/function docstrings of the standard library, parsed with ast (never imported)."""
    stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
    texts, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(stdlib_dir):
        # sorted in place so os.walk visits folders in the same order on every machine
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith((".", "config-")))
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith("test_"):
                continue
            with open(os.path.join(dirpath, filename), "rb") as f:
                source = f.read()
            try:
                with warnings.catch_warnings():  # invalid escapes in old sources warn while parsing
                    warnings.simplefilter("ignore")
                    tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars and doc not in seen:
                        seen.add(doc)
                        texts.append(doc)
    return texts


def chatterbot_conversations(languages=CHATTERBOT_LANGUAGES):
    """chatterbot-corpus dialogues as lists of utterances, in sorted (language, file) order."""
    import yaml
    import chatterbot_corpus
    data_dir = os.path.join(os.path.dirname(os.path.abspath(chatterbot_corpus.__file__)), "data")
    conversations = []
    for language in languages:
        lang_dir = os.path.join(data_dir, language)
        for filename in sorted(os.listdir(lang_dir)):
            if not filename.endswith((".yml", ".yaml")):
                continue
            with open(os.path.join(lang_dir, filename), encoding="utf-8") as f:
                # BaseLoader keeps every scalar a string ("yes" stays "yes", not True)
                doc = yaml.load(f, Loader=yaml.BaseLoader) or {}
            for conv in doc.get("conversations") or []:
                utterances = [str(u).strip() for u in conv if str(u).strip()]
                if len(utterances) >= 2:
                    conversations.append(utterances)
    return conversations


def pretrain_records(stdlib_dir=None):
    """All pretraining documents, shuffled with a fixed seed so kinds of text are mixed."""
    texts = pydoc_topic_texts() + stdlib_docstrings(stdlib_dir)
    texts += ["\n".join(conv) for conv in chatterbot_conversations()]
    random.Random(0).shuffle(texts)
    return [{"text": t} for t in texts]


def sft_records():
    """chatterbot dialogues as alternating user/assistant turns, ending on an assistant turn."""
    records = []
    for conv in chatterbot_conversations():
        conv = conv[:len(conv) // 2 * 2]  # a trailing user turn has no answer to learn from
        roles = ["user", "assistant"] * (len(conv) // 2)
        records.append({"conversations": [{"role": r, "content": c} for r, c in zip(roles, conv)]})
    random.Random(0).shuffle(records)
    return records


def _write_jsonl_atomic(records, path):
    """Write records as JSONL to a temporary file, then rename it over `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)  # readers see the old file or the complete new one, never a partial
    return path


def build_demo_data(kind, out_dir=DATASET_DIR, stdlib_dir=None):
    """(Re)build one demo corpus ("pretrain" or "sft") into out_dir; returns its path.

    stdlib_dir: where pretraining docstrings are read from (default: this Python's standard library).
    """
    if kind not in DEMO_FILES:
        raise ValueError(f"unknown demo data kind {kind!r}, expected one of {sorted(DEMO_FILES)}")
    records = pretrain_records(stdlib_dir) if kind == "pretrain" else sft_records()
    return _write_jsonl_atomic(records, os.path.join(out_dir, DEMO_FILES[kind]))


def ensure_demo_data(kind, out_dir=DATASET_DIR):
    """Path of the demo corpus `kind`, building it first if it does not exist yet."""
    if kind not in DEMO_FILES:
        raise ValueError(f"unknown demo data kind {kind!r}, expected one of {sorted(DEMO_FILES)}")
    path = os.path.join(out_dir, DEMO_FILES[kind])
    return path if os.path.exists(path) else build_demo_data(kind, out_dir)


if __name__ == "__main__":
    for kind in DEMO_FILES:
        path = build_demo_data(kind)
        with open(path, encoding="utf-8") as f:
            n_lines = sum(1 for _ in f)
        print(f"{kind}: {path}  {os.path.getsize(path) / 1e6:.2f} MB, {n_lines} records")
