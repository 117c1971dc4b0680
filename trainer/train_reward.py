"""Reward model (TRL's RewardTrainer, for GRPO/PPO's --reward_model): a scalar head on the trunk trained with the
Bradley-Terry loss on chosen/rejected chat pairs (DPO's format, an optional "margin" column); same flags and loop as
SFT. Writes out/reward_<hidden>.pth (trunk + score.weight) and out/reward_<hidden>_hf/, transformers'
Qwen3ForSequenceClassification with the tokenizer."""
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
from trainer.stages.reward import RewardPlan


def main():
    # TRL's RewardTrainer defaults where MiniMind has none: lr 1e-5 on the SFT model, rows of 1024 tokens
    args = parse_args("MiniMind reward model", RewardPlan, save_weight="reward", from_weight="full_sft",
                      learning_rate=1e-5, max_seq_len=1024, batch_size=4, accumulation_steps=1, epochs=1)
    # 1. set-up: checks -> TrainPlan (+ RewardPlan: no --pp, no --packing), process group, mesh, seed
    plan, dims = setup(args, RewardPlan)
    # 2. tokenizer and preference pairs (the embedded DPO demo pairs unless --data_path)
    train_ds, _ = load_datasets(plan)
    # 3. the objective: Bradley-Terry on the score at each row's last token
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, model (from --from_weight) + score head, parallel wrap (tp, dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective)
    # 8. the loop
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
