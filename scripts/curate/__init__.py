"""The curation library of scripts/curate_data.py (the command): the steps on datatrove (steps.py), their exact faster
equivalents of datatrove's per-document work (fast.py), its MinHash signatures a batch of documents at a time
(minhash.py), the strict input rows (rows.py), how a stage runs on datatrove's executors (executor.py) and the report
(report.py). Imports datatrove, numpy, orjson and tokenizers, no torch and nothing of the trainer: pool workers
inherit what this package loads."""
