"""Agent RL (MiniMind-3's train_agent.py): each step the policy plays every prompt num_generations times as a
multi-turn episode with MiniMind-3's mock tools (a tool call gets the tool's answer and a next turn), a rule rewards
each episode against the row's ground truth, and GRPO's loss trains the model's own tokens, never the tools' answers
(trainer/rl/agent.py); same loop, layouts, checkpoints and sinks as the other stages."""
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
from trainer.rl.agent import AgentPlan


def build(args):
    """Phases 1-7: the plan, agent_rl prompts, rewards, reference, rollout engine and the Trainer; returns (trainer,
    train_ds)."""
    # 1. set-up: checks -> TrainPlan (+ AgentPlan; rows of prompt + completion tokens), process group, mesh, seed
    plan, dims = setup(args, AgentPlan)
    # 2. tokenizer and agent_rl prompts with their tools (the embedded demo rows unless --data_path)
    train_ds, _ = load_datasets(plan)
    # 3. the objective: rewards, the frozen reference (the starting weights; none without a KL term), the rollout engine
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, policy model (from --from_weight), parallel wrap, optimizer
    return build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective), train_ds


def agent_args():
    # MiniMind's agent defaults: lr 3e-7, prompts up to 1024 tokens, 768 per turn, 4 episodes per prompt, cispo
    return parse_args("MiniMind Agent RL", AgentPlan, save_weight="agent", from_weight="full_sft",
                      learning_rate=3e-7, max_seq_len=1024, max_gen_len=768, num_generations=4, thinking_ratio=0.1,
                      batch_size=2, accumulation_steps=1, epochs=1, log_interval=1, save_interval=10,
                      wandb_project="MiniMind-Agent-RL")


def main():
    trainer, train_ds = build(agent_args())
    # 8. the loop: each step plays its prompts out as episodes first (objective.prepare)
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
