"""Knowledge distillation on chat data: a frozen teacher's token distributions guide the student (MiniMind's
alpha * CE + (1 - alpha) * T^2 * KL over the assistant tokens); same flags, loop, layouts and checkpoints as SFT."""
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
from trainer.stages.distillation import DistillationPlan


def main():
    args = parse_args("MiniMind Knowledge Distillation", DistillationPlan, save_weight="full_dist",
                      from_weight="full_sft", learning_rate=5e-6, max_seq_len=340, batch_size=32,
                      accumulation_steps=1, epochs=6, wandb_project="MiniMind-Distillation", packing=1)
    # 1. set-up: checks (the teacher's too) -> TrainPlan, process group, mesh, seed
    plan, dims = setup(args, DistillationPlan)
    # 2. tokenizer and data (the embedded chat corpus unless --data_path); --packing 1: rows of whole conversations
    train_ds, eval_ds = load_datasets(plan)
    # 3. the objective: the teacher, frozen, eval mode, the training dtype, split like the student (tp, cp)
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, student (from --from_weight), parallel wrap (tp, cp, dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective)
    # 8. the loop
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
