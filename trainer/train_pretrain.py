"""Pretrain a MiniMind model: `python trainer/train_pretrain.py` (one process) or under torchrun (4D)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

from transformers import AutoTokenizer  # noqa: E402

from dataset.lm_dataset import PretrainDataset  # noqa: E402
from dataset.token_cache import local_part  # noqa: E402
from trainer.flags import parse_args  # noqa: E402
from trainer.launch import main_guard  # noqa: E402
from trainer.train_loop import build_trainer, load_datasets, setup, steps_per_epoch, train  # noqa: E402


def main():
    args = parse_args("MiniMind Pretraining", save_weight="pretrain", learning_rate=5e-4, max_seq_len=340,
                      batch_size=32, accumulation_steps=8, epochs=1, packing=1)
    # 1. set-up: checks -> TrainPlan, process group, mesh, seed
    plan, dims = setup(args)
    # 2. tokenizer and data (the embedded demo corpus unless --data_path)
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_path)
    train_ds, eval_ds = load_datasets(plan, lambda path: PretrainDataset(
        path, tokenizer, max_length=plan.seq_len, packing=plan.packing, doc_mask=plan.doc_mask,
        skip_bad_lines=plan.skip_bad_lines, cache_dir=plan.cache_dir,
        num_proc=plan.num_proc, part=local_part()), demo_kind="pretrain")
    # 3-6. resume state, model, parallel wrap (pp -> tp -> cp -> dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds))
    # 7. the loop
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
