"""Checkpoints and weights files: step directories (checkpoint.py, rank_files.py), resume checks (resume_fields.py),
MiniMind's resume file, the run's weights (weights_file.py, weight_flags.py), the tokenizer record, storage checks.
May import runtime/, parallel/ and model/; never core/, stages/, rl/ or an entry script."""
