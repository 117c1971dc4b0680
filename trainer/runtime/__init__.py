"""What runs around the step: launch and collectives, the guard (non-finite steps, signals), out-of-memory, rank logs,
optimizers, schedules, callbacks, the console (bar and records), tracking and metrics. May import parallel/,
ckpt/ and model/; never core/'s loop, stages/, rl/ or an entry script."""
