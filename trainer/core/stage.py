"""Moved: trainer/plan/stage.py (the stage contract). Its names stay importable here for code written against the old
path."""
from trainer.plan.stage import SIDECAR_BYTES, SFTStage, Stage  # noqa: F401
