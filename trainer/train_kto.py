"""KTO (TRL's KTOTrainer): unpaired chat rows, each answer labelled desirable (true) or not (false), against a frozen
reference model whose log-probs (of each row and of its KL row) are computed once before training; same flags and
loop as SFT."""
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
from trainer.stages.kto import KTOPlan


def main():
    # DPO's defaults (MiniMind's lr for preference tuning on the SFT model), TRL's beta 0.1
    args = parse_args("MiniMind KTO", KTOPlan, save_weight="kto", from_weight="full_sft",
                      learning_rate=4e-8, max_seq_len=1024, batch_size=4, accumulation_steps=1, epochs=1)
    # 1. set-up: checks -> TrainPlan (+ KTOPlan: --beta, the weights, the reference), process group, mesh, seed
    plan, dims = setup(args, KTOPlan)
    # 2. tokenizer and labelled rows (the embedded demo rows unless --data_path), each with its KL row
    train_ds, _ = load_datasets(plan)
    # 3. the objective: the reference's log-probs of every row and KL row, cached, or computed in this layout
    objective = plan.stage.objective(plan, dims, train_ds)
    # 4-7. resume state, policy model (from --from_weight), parallel wrap (tp, dp), optimizer
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective)
    # 8. the loop (each step: the KL baseline's forward, then the rows')
    train(trainer, train_ds)


if __name__ == "__main__":
    main_guard(main)
