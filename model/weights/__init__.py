"""MiniMind's weights as files, in the model's terms: the .pth + sidecar writer and reader (files.py), the file names
and the path rule (paths.py). Imports model/ and nothing above it."""
