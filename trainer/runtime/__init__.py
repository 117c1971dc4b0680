"""What runs around the step: the guard (non-finite steps, signals), out-of-memory, optimizers, schedules,
callbacks, the console (bar and records), tracking, the step profiler (--profile_steps) and metrics.
Floor 5: may import judge/, ckpt/, parallel/, base/, model/ and dataset/."""
