"""LoRA fine-tuning on chat data (MiniMind's train_lora.py): the SFT loss, base frozen, only the adapters train.

The adapters go to <save_dir>/lora/<lora_name>_<hidden>[_moe].pth (MiniMind's format) and a PEFT folder beside it;
resume checkpoints, layouts and flags are those of every stage.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports
from trainer.base.prelude import loading  # first: a line at once, Ctrl-C during the imports in one line

loading(__name__, "torch, transformers and the trainer")

from trainer.base.launch import main_guard
from trainer.base.log import Logger
from trainer.core.build import build_trainer, setup, steps_per_epoch
from trainer.core.data_loading import load_datasets
from trainer.core.loop import train
from trainer.plan.flags import parse_args
from trainer.stages.lora import LoraPlan


def main():
    # save_weight None: the run (checkpoints, metrics) takes the adapter's name, as MiniMind's lm_checkpoint does
    args = parse_args("MiniMind LoRA", LoraPlan, save_weight=None, from_weight="full_sft",
                      learning_rate=1e-4, max_seq_len=340, batch_size=32, accumulation_steps=1, epochs=2, packing=1)
    if args.save_weight is None:
        args.save_weight = args.lora_name
    # 1. set-up: checks -> TrainPlan (+ LoraPlan), process group, mesh, seed
    plan, dims = setup(args, LoraPlan)
    Logger(f"LoRA on --from_weight {plan.model.from_weight}; adapters to {plan.stage.weights_path(plan)}")
    # 2. tokenizer and data (the embedded chat corpus unless --data_path); --packing 1: rows of whole conversations
    train_ds, eval_ds = load_datasets(plan)
    # 3-7. the objective (SFT's), resume state, model (from --from_weight) + adapters, parallel wrap
    # (trainer/parallel/parallelize.py's order), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds))
    # 8. the loop
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
