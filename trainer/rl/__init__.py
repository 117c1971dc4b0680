"""The RL stages: their base (base.py), the rollout engine, rewards, training rows, policy losses, GRPO, PPO, agent
RL and on-policy distillation (gkd.py: the student samples, the teacher grades). Floor 10, the last below the entry
scripts: may import every floor below (stages/ for the reference model and the teacher, core/'s helpers), never
core/loop.py."""
