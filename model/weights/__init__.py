"""MiniMind's weights as files, in the model's terms: the .pth + sidecar writer and reader (files.py). Imports model/
and nothing above it."""
