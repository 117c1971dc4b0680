"""The errors the trainer's floors raise, each with its exit code (trainer/base/launch.py main_guard reports them); bad
user input, ConfigError, is model/errors.py's (below the trainer: scripts/inference raises it too)."""
import signal


class TrainingHalted(Exception):
    """The run stopped itself (non-finite steps in a row, diverged replicas): one line, exit code 3."""


class SignalStop(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped the run: exit code 128 + signum (130, 143), so `a && b` stops. `message`: the line to
    print (None: the loop said it already, after saving)."""

    def __init__(self, signum, message=None):
        super().__init__(message or signal.Signals(signum).name)
        self.signum, self.message = signum, message
