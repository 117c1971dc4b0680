"""Pretrain a MiniMind model: `python trainer/train_pretrain.py` (one process) or under torchrun (4D)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoTokenizer  # noqa: E402

from dataset.lm_dataset import PretrainDataset  # noqa: E402
from trainer.train_loop import load_datasets, main_guard, parse_args, setup, train  # noqa: E402
from trainer.trainer_utils import repo_path  # noqa: E402


def main():
    args = parse_args("MiniMind Pretraining", save_weight="pretrain", learning_rate=5e-4, max_seq_len=340,
                      batch_size=32, accumulation_steps=8, epochs=1, packing=1)
    # 1. set-up: checks, process group, mesh, seed
    if args.data_path is None:
        from dataset.demo_data import ensure_demo_data
        args.data_path = ensure_demo_data("pretrain")  # the embedded corpus, built on first use
    config, run = setup(args)
    # 2. tokenizer and data
    tokenizer = AutoTokenizer.from_pretrained(repo_path(args.tokenizer_path))
    train_ds, eval_ds = load_datasets(args, lambda path: PretrainDataset(
        path, tokenizer, max_length=args.max_seq_len, packing=bool(args.packing), skip_bad_lines=bool(args.skip_bad_lines)))
    # 3-7. model, optimizer, resume, parallel wrap, loop
    train(args, config, run, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
