"""The loop and the step (loop.py), building the Trainer (build.py), batches, evaluation, data loading,
log-probs and rows whose sequences share a prefix (shared_prefix.py; stage.py and objective.py are the old paths of
plan/'s stage contract). Floor 8: may import plan/, runtime/, observe/, judge/, ckpt/, parallel/, base/, model/,
dataset/."""
