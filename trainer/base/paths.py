"""The path rule and the names of files, for the trainer's floors: model/weight_names.py holds them (the inference
library reads them too, and must not import the trainer)."""
from model.weight_names import ROOT, file_digest, repo_path, typed_or_default, weight_name  # noqa: F401
