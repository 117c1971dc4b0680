"""Moved: trainer/plan/objective.py (the objective contract). Its names stay importable here for code written against
the old path."""
from trainer.plan.objective import LMObjective, cross_entropy_sum, target_tokens  # noqa: F401
