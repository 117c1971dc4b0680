"""The loop and the step (loop.py), building the Trainer (build.py), the Stage/Objective contract (stage.py,
objective.py), batches, evaluation, data loading and log-probs. May import plan/, ckpt/, runtime/, parallel/,
model/, dataset/; never stages/ or rl/ (stages sit above the loop and import its helpers) nor an entry script."""
