"""Checkpoints and weights files: step directories (resume.py: their layout, reading and the resume checks; parts.py:
the parts by registry; step_dirs.py, with each rank's own files), one run per directory (run_lock.py), MiniMind's resume
file, the run's weights (weights_file.py), the tokenizer record, storage checks.
Floor 3: may import parallel/, base/, model/ and dataset/."""
