"""MiniMind's weights as files, in the model's terms: the .pth + sidecar writer and reader (files.py), the file names
and the path rule (paths.py), what a state dict holds and whether it fits a config (shapes.py), and its problems worded
as the flags that fix them (flag_advice.py). Imports model/ and nothing above it."""
