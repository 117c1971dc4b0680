"""The step's policy, what decides around the step: the guard (non-finite steps, signals), out-of-memory, optimizers,
schedules, callbacks and the MoE experts' loads and routing bias. Floor 6: may import observe/, judge/, ckpt/,
parallel/, base/, model/ and dataset/."""
