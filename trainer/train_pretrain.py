"""Pretrain a MiniMind model: `python trainer/train_pretrain.py` (one process) or under torchrun (4D)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from trainer.base.prelude import loading  # first: a line at once, Ctrl-C during the imports in one line

loading(__name__, "torch, transformers and the trainer")

from trainer.base.launch import main_guard
from trainer.core.build import build_trainer, setup, steps_per_epoch
from trainer.core.data_loading import load_datasets
from trainer.core.loop import train
from trainer.plan.flags import parse_args
from trainer.plan.stage import Stage


def main():
    args = parse_args("MiniMind Pretraining", Stage, save_weight="pretrain", learning_rate=5e-4, max_seq_len=340,
                      batch_size=32, accumulation_steps=8, epochs=1, packing=1)
    # 1. set-up: checks -> TrainPlan, process group, mesh, seed
    plan, dims = setup(args, Stage)
    # 2. tokenizer and data (the embedded demo corpus unless --data_path)
    train_ds, eval_ds = load_datasets(plan)
    # 3-7. the objective (next-token cross-entropy, the default), resume state, model, parallel wrap
    # (trainer/parallel/parallelize.py's order), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds))
    # 8. the loop
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
