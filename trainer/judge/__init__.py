"""Judging a run while it trains: units that compare across tokenizers (bits per byte, repetition), the health lines
that say what to try, greedy samples at each eval, benchmark scores through lm-eval (docs/judging.md).
Floor 4: may import ckpt/, parallel/, base/, model/ and dataset/."""
