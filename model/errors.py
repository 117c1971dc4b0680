"""Bad user input, for every floor that reads flags: ConfigError (one line, exit code 2) and the device check that the
trainer and the inference library (scripts/inference/) both make."""
import torch


class ConfigError(Exception):
    """Bad user input: reported as one line, exit code 2, before training starts."""


def check_device(device):
    """--device names a cpu or cuda device (available)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device} is not a device this trainer runs on; use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} but no CUDA device is available; use --device cpu")
