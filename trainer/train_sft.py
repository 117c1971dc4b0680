"""Supervised fine-tuning on chat data (assistant-only loss); same flags and loop as pretraining."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoTokenizer  # noqa: E402

from dataset.lm_dataset import SFTDataset  # noqa: E402
from trainer.train_loop import load_datasets, main_guard, parse_args, setup, train  # noqa: E402
from trainer.trainer_utils import repo_path  # noqa: E402


def main():
    args = parse_args("MiniMind Full SFT", save_weight="full_sft", from_weight="pretrain", learning_rate=1e-5,
                      max_seq_len=340, batch_size=16, accumulation_steps=1, epochs=2)
    # 1. set-up: checks, process group, mesh, seed
    if args.data_path is None:
        from dataset.demo_data import ensure_demo_data
        args.data_path = ensure_demo_data("sft")  # the embedded chat corpus, built on first use
    config, run = setup(args)
    # 2. tokenizer and data
    tokenizer = AutoTokenizer.from_pretrained(repo_path(args.tokenizer_path))
    train_ds, eval_ds = load_datasets(args, lambda path: SFTDataset(
        path, tokenizer, max_length=args.max_seq_len, skip_bad_lines=bool(args.skip_bad_lines)))
    # 3-7. model, optimizer, resume, parallel wrap, loop
    train(args, config, run, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
