"""Group Relative Policy Optimization (MiniMind's train_grpo.py): each step the policy completes every prompt
num_generations times, rewards score the completions, and the policy moves toward the better ones of each group
(trainer/grpo.py); same loop, layouts, checkpoints and sinks as the other stages."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

from trainer.flags import add_grpo_args, parse_args  # noqa: E402
from trainer.grpo import GRPOObjective, describe, resolve_grpo  # noqa: E402
from trainer.launch import main_guard  # noqa: E402
from trainer.rl_stage import build_rl_trainer  # noqa: E402
from trainer.train_loop import train  # noqa: E402


def build(args):
    """Phases 1-7 (trainer/rl_stage.build_rl_trainer): the plan, prompts, rewards, reference, rollout engine and the
    Trainer; returns (trainer, train_ds)."""
    return build_rl_trainer(args, resolve_grpo, GRPOObjective, describe)


def grpo_args():
    # MiniMind's GRPO defaults: lr 3e-7, prompts up to 768 tokens, 2 prompts per step, a save every 10 steps
    return parse_args("MiniMind GRPO", stage_args=add_grpo_args, save_weight="grpo", from_weight="full_sft",
                      learning_rate=3e-7, max_seq_len=768, batch_size=2, accumulation_steps=1, epochs=1,
                      log_interval=1, save_interval=10, wandb_project="MiniMind-GRPO")


def main():
    trainer, train_ds = build(grpo_args())
    # 8. the loop: each step rolls out its prompts first (objective.prepare)
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
