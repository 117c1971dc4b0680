"""The trainer: entry scripts `train_<stage>.py` (MiniMind's names and flags, numbered phases) and trainer_utils.py
(MiniMind's helpers by their names) at this level; the rest in folders by concern:
core/ (the loop and the step), plan/ (flags -> one frozen TrainPlan), ckpt/ (checkpoints and weights files),
runtime/ (launch, guard, logs, optimizers, schedules, metrics), stages/ (post-training stages), rl/ (the RL stages),
parallel/ (one module per parallel dimension). No module imports an entry script; only train_full_sft.py, MiniMind's
name for train_sft.py, runs train_sft's main."""
