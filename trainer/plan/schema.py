"""Moved: trainer/base/schema.py (the flag schema). Its names stay importable here for code written against the old
path."""
from trainer.base.schema import Flag, field_flag, fill, flag, section_flags  # noqa: F401
