"""Direct preference optimization (MiniMind's train_dpo.py): sigmoid DPO on chosen/rejected chat pairs against a
frozen reference model, whose log-probs are computed once before training; same flags and loop as SFT."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

from transformers import AutoTokenizer  # noqa: E402

from dataset.lm_dataset import DPODataset  # noqa: E402
from dataset.token_cache import local_part  # noqa: E402
from trainer.dpo import DPOObjective, resolve_dpo  # noqa: E402
from trainer.dpo_reference import attach_reference  # noqa: E402
from trainer.flags import add_dpo_args, parse_args  # noqa: E402
from trainer.launch import main_guard  # noqa: E402
from trainer.train_loop import build_trainer, load_datasets, setup, steps_per_epoch, train  # noqa: E402
from trainer.trainer_utils import Logger  # noqa: E402


def main():
    # MiniMind's DPO defaults: lr 4e-8 ("<= 5e-8, or the model forgets"), beta 0.15, rows of 1024 tokens
    args = parse_args("MiniMind DPO", stage_args=add_dpo_args, save_weight="dpo", from_weight="full_sft",
                      learning_rate=4e-8, max_seq_len=1024, batch_size=4, accumulation_steps=1, epochs=1)
    # 1. set-up: checks -> TrainPlan (+ DPOPlan: --beta, the reference), process group, mesh, seed
    plan, dims = setup(args, resolve_stage=resolve_dpo)
    Logger(f"DPO from --from_weight {plan.from_weight} (the SFT stage's output by default), "
           f"reference {plan.stage.ref_weight}, beta {plan.stage.beta}")
    # 2. tokenizer and preference pairs (the embedded demo pairs unless --data_path)
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_path)
    train_ds, _ = load_datasets(plan, lambda path: DPODataset(
        path, tokenizer, max_length=plan.seq_len, skip_bad_lines=plan.skip_bad_lines,
        cache_dir=plan.cache_dir, num_proc=plan.num_proc, part=local_part()), demo_kind="dpo")
    # 3. the reference model's log-probs of every pair: cached, or computed in this layout, the model then dropped
    objective = DPOObjective(plan.stage.beta)
    attach_reference(plan, dims, train_ds, objective)
    # 4-7. resume state, policy model (from --from_weight), parallel wrap (pp -> tp -> dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective=objective)
    # 8. the loop
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
