"""Supervised fine-tuning on chat data (assistant-only loss); same flags and loop as pretraining."""
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
from trainer.stages.sft import SFTStage


def main():
    args = parse_args("MiniMind Full SFT", SFTStage, save_weight="full_sft", from_weight="pretrain", learning_rate=1e-5,
                      max_seq_len=340, batch_size=16, accumulation_steps=1, epochs=2, packing=1)
    # 1. set-up: checks -> TrainPlan, process group, mesh, seed
    plan, dims = setup(args, SFTStage)
    # 2. tokenizer and data (the embedded chat corpus unless --data_path); --packing 1: rows of whole conversations
    train_ds, eval_ds = load_datasets(plan)
    # 3-7. the objective (cross-entropy on the assistant's tokens), resume state, model (from --from_weight), parallel
    # wrap (trainer/parallel/parallelize.py's order), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds))
    # 8. the loop
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
