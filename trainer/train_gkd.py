"""On-policy distillation (GKD, TRL's GKDTrainer): the student completes the chat prompts itself on a share --lmbda of
the steps (the data's answers on the others), and learns the teacher's whole next-token distribution on those tokens
through the generalized JSD (--beta: 0 forward KL, 1 reverse KL); trainer/rl/gkd.py. Same loop, checkpoints and
sinks as the other stages; the teacher is loaded as train_distillation.py loads it."""
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
from trainer.rl.gkd import GKDPlan


def build(args):
    """Phases 1-7: the plan, chat data, teacher, rollout engine, Trainer; returns (trainer, train_ds, eval_ds)."""
    # 1. set-up: checks (the teacher's too) -> TrainPlan (+ GKDPlan; rows of prompt + completion), process group, seed
    plan, dims = setup(args, GKDPlan)
    # 2. tokenizer and chat data (the embedded corpus unless --data_path); a row's first answer follows its prompt
    train_ds, eval_ds = load_datasets(plan)
    # 3. the objective: the teacher (frozen, eval mode, the training dtype) and the student's rollout engine
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, student (from --from_weight), parallel wrap (data parallel), optimizer
    return build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective), train_ds, eval_ds


def gkd_args():
    # train_distillation.py's student, teacher and learning rate; TRL GKD's beta, lmbda, temperature and 128 new tokens
    return parse_args("MiniMind On-Policy Distillation (GKD)", GKDPlan, save_weight="full_gkd",
                      from_weight="full_sft", learning_rate=5e-6, max_seq_len=340, batch_size=8, accumulation_steps=1,
                      epochs=1, max_gen_len=128, temperature=0.9, wandb_project="MiniMind-GKD")


def main():
    trainer, train_ds, eval_ds = build(gkd_args())
    # 8. the loop: an on-policy step completes its prompts first (objective.prepare)
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
