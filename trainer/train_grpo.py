"""Group Relative Policy Optimization (MiniMind's train_grpo.py): each step the policy completes every prompt
num_generations times, rewards score the completions, and the policy moves toward the better ones of each group
(trainer/rl/grpo.py); same loop, layouts, checkpoints and sinks as the other stages."""
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
from trainer.rl.grpo import GRPOPlan


def build(args):
    """Phases 1-7: the plan, prompts, rewards, reference, rollout engine and the Trainer; returns (trainer,
    train_ds)."""
    # 1. set-up: checks -> TrainPlan (+ GRPOPlan; rows of prompt + completion tokens), process group, mesh, seed
    plan, dims = setup(args, GRPOPlan)
    # 2. tokenizer and prompts (the embedded demo prompts unless --data_path)
    train_ds, _ = load_datasets(plan)
    # 3. the objective: rewards, the frozen reference (the starting weights; none without a KL term), the rollout engine
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, policy model (from --from_weight), parallel wrap, optimizer
    return build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective), train_ds


def grpo_args():
    # MiniMind's GRPO defaults: lr 3e-7, prompts up to 768 tokens, 2 prompts per step, a save every 10 steps
    return parse_args("MiniMind GRPO", GRPOPlan, save_weight="grpo", from_weight="full_sft",
                      learning_rate=3e-7, max_seq_len=768, batch_size=2, accumulation_steps=1, epochs=1,
                      log_interval=1, save_interval=10, wandb_project="MiniMind-GRPO")


def main():
    trainer, train_ds = build(grpo_args())
    # 8. the loop: each step rolls out its prompts first (objective.prepare)
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
