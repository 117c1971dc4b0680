"""The RL stages: their base (base.py), the rollout engine, rewards, training rows, policy losses, GRPO, PPO, agent
RL and on-policy distillation (gkd.py: the student samples, the teacher grades). May import core/ (below the loop),
stages/ (shared pieces such as the reference model and the teacher), plan/, ckpt/, runtime/, parallel/; never
core/loop.py or an entry script."""
