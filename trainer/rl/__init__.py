"""The RL stages: their base (base.py), the rollout engine, rewards, training rows, policy losses, GRPO, PPO and
agent RL. May import core/ (below the loop), stages/ (shared pieces such as the reference model), plan/, ckpt/,
runtime/, parallel/; never core/loop.py or an entry script."""
