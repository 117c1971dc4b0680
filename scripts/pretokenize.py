"""Tokenize a JSONL/parquet corpus once into a token shard that training reads through numpy.memmap.

    python scripts/pretokenize.py --data_path dataset/pretrain_demo.jsonl            # -> dataset/pretrain_demo.bin
    python scripts/pretokenize.py --data_path big.jsonl --num_proc 16                 # 16 tokenizer processes
    python trainer/train_pretrain.py --data_path dataset/pretrain_demo.bin ...

Writes, per input file, <prefix>.bin (uint16 tokens, uint32 when the vocabulary exceeds 65536),
<prefix>.idx (int64 document offsets, num_docs + 1), <prefix>.mask (uint8 loss mask, SFT only) and
<prefix>.json (meta, including the tokenizer fingerprint the dataset checks on load). Documents are
bos + text + eos, exactly as PretrainDataset tokenizes them on the fly (the same code builds both).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "transformers and the datasets")

from transformers import AutoTokenizer  # noqa: E402

from dataset.chat import SFTDataset  # noqa: E402
from dataset.lm_dataset import PretrainDataset  # noqa: E402
from dataset.shards import shard_files, tokenizer_fingerprint  # noqa: E402
from dataset.tokenizing.token_cache import default_num_proc  # noqa: E402
from model.atomic import atomic_write_text  # noqa: E402
from model.errors import ConfigError  # noqa: E402
from model.tokenizer_choice import check_tokenizer  # noqa: E402
from trainer.plan.checks import check_writable  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here


def pretokenize(data_path, out_prefix, tokenizer, kind="pretrain", skip_bad_lines=False, num_proc=None):
    """Tokenize `data_path` into the shard `out_prefix`.{bin,idx,json} with `num_proc` worker processes (default:
    the cores available), through the token cache's code; returns the meta dict."""
    out_dir = os.path.dirname(os.path.abspath(out_prefix))
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".pretokenize_", dir=out_dir)  # same filesystem: the moves are renames
    try:
        dataset_class = PretrainDataset if kind == "pretrain" else SFTDataset
        # the cache holds whole documents whatever the row length; SFT counts rows with a target within it, so a
        # row length no conversation reaches keeps that count (an all-empty file is still refused)
        max_length = 2 if kind == "pretrain" else 2 ** 31 - 1
        ds = dataset_class(data_path, tokenizer, max_length=max_length, skip_bad_lines=skip_bad_lines,
                           cache_dir=work, num_proc=num_proc)
        files = shard_files(out_prefix)
        for name in ("tokens", "offsets", "mask"):
            source = os.path.join(ds.cache_path, f"{name}.bin")
            if os.path.exists(source):
                os.replace(source, files[name])
            elif os.path.exists(files[name]):
                os.remove(files[name])  # a stale mask from an earlier shard of the same name
        meta = dict(ds.meta, kind=kind, tokenizer=tokenizer_fingerprint(tokenizer))
        atomic_write_text(files["meta"], json.dumps(meta, indent=1))  # last: a shard with its meta is whole
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", nargs="+", required=True, help="JSONL or parquet file(s); one shard each")
    parser.add_argument("--out_dir", default=None, help="where shards go (default: beside each input)")
    parser.add_argument("--tokenizer_path", default=os.path.join(ROOT, "model"))
    parser.add_argument("--kind", default="pretrain", choices=["pretrain", "sft"])
    parser.add_argument("--skip_bad_lines", type=int, default=0, choices=[0, 1])
    parser.add_argument("--num_proc", type=int, default=default_num_proc(),
                        help="tokenizer worker processes (default: the cores available)")
    args = parser.parse_args()
    if args.num_proc < 1:
        fail(f"--num_proc must be at least 1, got {args.num_proc}")
    try:
        check_tokenizer(os.path.abspath(args.tokenizer_path))
        if args.out_dir:
            check_writable(os.path.abspath(args.out_dir), "--out_dir")
    except ConfigError as e:
        fail(str(e))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    for path in args.data_path:
        stem = os.path.splitext(os.path.basename(path))[0]
        prefix = os.path.join(args.out_dir or os.path.dirname(os.path.abspath(path)), stem)
        try:
            meta = pretokenize(path, prefix, tokenizer, args.kind, bool(args.skip_bad_lines), args.num_proc)
        except (ValueError, FileNotFoundError) as e:  # bad lines, empty or missing files: say which, no traceback
            fail(str(e))
        print(f"{path} -> {prefix}.bin: {meta['num_docs']} documents, {meta['num_tokens']} tokens "
              f"({meta['token_dtype']}), {meta['num_bad_lines']} bad lines skipped")


if __name__ == "__main__":
    main()
