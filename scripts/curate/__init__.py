"""The curation library of scripts/curate_data.py (the command): the steps on datatrove (steps.py), their exact faster
equivalents of datatrove's per-document work (fast.py) and the report (report.py)."""
