"""Agent RL (MiniMind-3's train_agent.py): each step the policy plays every prompt num_generations times as a
multi-turn episode with MiniMind-3's mock tools (a tool call gets the tool's answer and a next turn), a rule rewards
each episode against the row's ground truth, and GRPO's loss trains the model's own tokens, never the tools' answers
(trainer/agent.py); same loop, layouts, checkpoints and sinks as the other stages."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

from trainer.agent import AGENT_RULES, AgentObjective, describe_agent, resolve_agent  # noqa: E402
from trainer.flags import add_agent_args, parse_args  # noqa: E402
from trainer.launch import main_guard  # noqa: E402
from trainer.rl_stage import build_rl_trainer  # noqa: E402
from trainer.train_loop import train  # noqa: E402


def build(args):
    """Phases 1-7 (trainer/rl_stage.build_rl_trainer): the plan, agent_rl prompts (the embedded demo rows unless
    --data_path), rewards, reference, rollout engine and the Trainer; returns (trainer, train_ds)."""
    return build_rl_trainer(args, resolve_agent, AgentObjective, describe_agent, demo_kind="agent", rules=AGENT_RULES)


def agent_args():
    # MiniMind's agent defaults: lr 3e-7, prompts up to 1024 tokens, 768 per turn, 4 episodes per prompt, cispo
    return parse_args("MiniMind Agent RL", stage_args=add_agent_args, save_weight="agent", from_weight="full_sft",
                      learning_rate=3e-7, max_seq_len=1024, max_gen_len=768, num_generations=4, thinking_ratio=0.1,
                      batch_size=2, accumulation_steps=1, epochs=1, log_interval=1, save_interval=10,
                      wandb_project="MiniMind-Agent-RL")


def main():
    trainer, train_ds = build(agent_args())
    # 8. the loop: each step plays its prompts out as episodes first (objective.prepare)
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
