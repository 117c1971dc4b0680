"""What an entry script does before its heavy imports (torch, transformers and the code on them take 2-15 s under
load): one line saying what it is loading, at once, and a Ctrl-C or SIGTERM during those imports turned into one line
and exit 130/143 instead of Python's traceback. Standard library only, so that it runs in the first second.

    sys.path.insert(0, ROOT)
    from trainer.base.prelude import loaded, loading  # noqa: E402
    loading(__name__, "torch, transformers and the trainer")
    import torch  # ... the heavy imports
    loaded()  # scripts whose main handles Ctrl-C itself; a trainer's main_guard installs its own handlers
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_previous = {}


def loading(name, what):
    """Run as the main script (`name` is its __name__; imported, it does nothing): print '<script>: loading <what> ...'
    (rank 0 only under torchrun) and stop in one line on a signal until loaded() or main_guard replaces the handlers."""
    if name != "__main__":
        return
    def stop(signum, frame):
        # nothing has started yet: no file is open for writing, so leaving at once loses nothing
        print(f"{signal.Signals(signum).name}: stopped while loading {what}; nothing was started", file=sys.stderr,
              flush=True)
        os._exit(128 + signum)
    for sig in SIGNALS:  # before the line: a signal sent on seeing it finds the handler
        _previous[sig] = signal.signal(sig, stop)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)  # as the README names it, from any directory
    if os.environ.get("RANK", "0") == "0":
        print(f"{script}: loading {what} ...", flush=True)


def loaded():
    """The imports are done: the handlers the process had before loading() again (a script's own Ctrl-C handling)."""
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
