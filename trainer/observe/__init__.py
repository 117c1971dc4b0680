"""What a run shows of itself, without changing it: the console (bar and records), metrics (MFU, memory, tokens/s),
tracking (the metrics JSONL, TensorBoard, dashboards) and the step profiler (--profile_steps).
Floor 5: may import judge/, ckpt/, parallel/, base/, model/ and dataset/."""
