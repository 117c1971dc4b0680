"""The trainer: entry scripts `train_<stage>.py` (MiniMind's names and flags, numbered phases) and trainer_utils.py
(MiniMind's helpers by their names) on the top floor; the rest in folders that are floors, each importing only the
floors below it (docs/design.md, "Floors"): base/ (errors, ranks and collectives, the Logger, the flag schema,
paths) < parallel/ (one module per dimension) < ckpt/ (checkpoints and weights files) < judge/ (bits per byte,
health lines, samples) < observe/ (console, tracking, metrics, the step profiler) < runtime/ (guard, optimizers,
schedules, callbacks) < plan/ (the stage contract, flags -> one frozen TrainPlan) < core/ (the loop and the step) <
stages/ (post-training stages) < rl/ (the RL stages). Only an entry script imports an entry script
(train_full_sft.py runs train_sft.py's main)."""
