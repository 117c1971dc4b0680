"""Direct preference optimization (MiniMind's train_dpo.py): DPO (or --loss_type ipo, hinge, robust, simpo, orpo) on
chosen/rejected chat pairs against a frozen reference model, whose log-probs are computed once before training (none
for simpo and orpo); same flags and loop as SFT."""
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
from trainer.stages.dpo import DPOPlan


def main():
    # MiniMind's DPO defaults: lr 4e-8 ("<= 5e-8, or the model forgets"), beta 0.15, rows of 1024 tokens
    args = parse_args("MiniMind DPO", DPOPlan, save_weight="dpo", from_weight="full_sft",
                      learning_rate=4e-8, max_seq_len=1024, batch_size=4, accumulation_steps=1, epochs=1)
    # 1. set-up: checks -> TrainPlan (+ DPOPlan: --loss_type, --beta, the reference), process group, mesh, seed
    plan, dims = setup(args, DPOPlan)
    # 2. tokenizer and preference pairs (the embedded demo pairs unless --data_path)
    train_ds, _ = load_datasets(plan)
    # 3. the objective: the reference log-probs of every pair (cached, or computed here), none for simpo and orpo
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, policy model (from --from_weight), parallel wrap (pp, tp, dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective)
    # 8. the loop
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
