"""Checkpoints and weights files: step directories (checkpoint.py, parts.py: the parts by registry, step_dirs.py,
rank_files.py), one run per directory (run_lock.py), resume checks (resume_fields.py),
MiniMind's resume file, the run's weights (weights_file.py, weight_flags.py), the tokenizer record, storage checks.
Floor 3: may import parallel/, base/, model/ and dataset/."""
