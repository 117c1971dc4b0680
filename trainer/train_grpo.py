"""Group Relative Policy Optimization (MiniMind's train_grpo.py): each step the policy completes every prompt
num_generations times, rewards score the completions, and the policy moves toward the better ones of each group
(trainer/grpo.py); same loop, layouts, checkpoints and sinks as the other stages."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

from transformers import AutoTokenizer  # noqa: E402

from dataset.rlaif_dataset import RLAIFDataset  # noqa: E402
from trainer.dpo_reference import load_reference  # noqa: E402
from trainer.flags import add_grpo_args, parse_args  # noqa: E402
from trainer.grpo import GRPOObjective, describe, resolve_grpo  # noqa: E402
from trainer.launch import main_guard  # noqa: E402
from trainer.rl_stage import reward_functions, row_plan  # noqa: E402
from trainer.rollout import make_engine  # noqa: E402
from trainer.train_loop import autocast, build_trainer, load_datasets, setup, steps_per_epoch, train  # noqa: E402
from trainer.trainer_utils import Logger  # noqa: E402


def build(args):
    """Phases 1-7 (tests build a Trainer the same way): the plan, prompts, rewards, reference, rollout engine and the
    Trainer; returns (trainer, train_ds)."""
    # 1. set-up: checks -> TrainPlan (+ GRPOPlan; rows of prompt + completion tokens), process group, mesh, seed
    plan, dims = setup(args, resolve_stage=resolve_grpo)
    plan = row_plan(plan)
    # 2. tokenizer and prompts (the embedded demo prompts unless --data_path)
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_path)
    train_ds, _ = load_datasets(plan, lambda path: RLAIFDataset(
        path, tokenizer, max_length=plan.stage.max_prompt_len, thinking_ratio=plan.stage.thinking_ratio,
        seed=plan.seed, skip_bad_lines=plan.skip_bad_lines), demo_kind="rlaif")
    # 3. rewards, the frozen reference (the starting weights; none for --beta 0), the rollout engine
    functions, weights = reward_functions(plan.stage, plan.device)
    reference = load_reference(plan, dims) if plan.stage.beta else (None, None)
    engine = make_engine(plan, tokenizer, dims, lambda: autocast(plan))
    objective = GRPOObjective(plan.stage, plan, dims, engine, tokenizer, functions, weights, reference)
    Logger(describe(plan, objective))
    # 4-7. resume state, policy model (from --from_weight), parallel wrap, optimizer
    return build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective=objective), train_ds


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
