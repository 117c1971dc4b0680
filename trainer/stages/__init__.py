"""Post-training stages on the stage contract (plan/stage.py): SFT, LoRA, the DPO family and its reference pass, KTO,
the reward model, distillation. Floor 9: may import core/'s helpers (batches, log-probs, data loading; never
core/loop.py) and every floor below."""
