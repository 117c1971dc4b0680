"""Post-training stages on the stage contract (core/stage.py): LoRA, the DPO family and its reference pass, KTO, the
reward model, distillation.
May import core/ (below the loop: stage, objective, batches, log-probs), plan/, ckpt/, runtime/, parallel/;
never core/loop.py, rl/ or an entry script."""
