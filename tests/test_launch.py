"""trainer/base/launch.py: the backend follows the plan's device; token counts are summed on the CPU; a signal ends
main_guard's process in its one line and exit code wherever it lands."""
import pytest

from tests.helpers.launch import ROOT, forked, spawn
from trainer.base.launch import BEFORE_THE_LOOP, backend_for, count_sum


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl")])
def test_backend_follows_the_device_not_the_host(device, backend):
    """--device cpu on a GPU host must not put CPU tensors through NCCL (and cuda:N takes NCCL)."""
    assert backend_for(device) == backend


def _count_sum(rank, world_size, out):
    # ranks 0,1 are dp rank 0 (one tp pair: same count 5), ranks 2,3 dp rank 1 (count 7)
    value = 5 if rank < 2 else 7
    assert count_sum(value, replicas=2) == 12
    assert count_sum(rank) == 0 + 1 + 2 + 3
    assert count_sum([value, 1], replicas=2) == [12, 2]  # several counts in one collective (items, tokens)


def test_count_sum_over_data_parallel_on_the_cpu(tmp_path):
    spawn(_count_sum, 4, str(tmp_path), timeout=120, start_method="fork")


# An entry script as the trainer's are (prelude first, then main_guard), with SIGTERM sent to itself at one moment of
# main_guard's (argv[1]): os.kill checks for signals before it returns, so the handler runs there, not by chance.
WINDOW_SCRIPT = """import atexit, os, signal, sys
sys.path.insert(0, {root!r})
from trainer.base.prelude import loading
loading(__name__, "the window's script")
from trainer.base import launch, rank_log
from model.errors import ConfigError
from trainer.base.errors import SignalStop

WINDOW = sys.argv[1]


def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


real_install, real_leave, real_write, fired = launch.stop_on_signals, launch.leave_on_signals, rank_log.write, []


def installed():  # main_guard's handlers are in place, main() not begun
    real_install()
    sigterm()


def leave_on_signals(code, *line):  # main_guard begins its report of how main() ended (the handler passes a line)
    if not line and not fired:
        fired.append(code)
        sigterm()
    real_leave(code, *line)


def write(text):  # main_guard writes an error's traceback to the rank log, first thing in its report
    if text.startswith("error:"):
        sigterm()
    real_write(text)


if WINDOW == "installed":
    launch.stop_on_signals = installed
if WINDOW in ("refusal", "the loop's stop", "a second signal"):
    launch.leave_on_signals = leave_on_signals
if WINDOW == "an error":
    rank_log.write = write


class SignalsWhenCollected:
    def __del__(self):
        sigterm()


def main():
    if WINDOW == "refusal":
        raise ConfigError("--flag is wrong")
    if WINDOW == "the loop's stop":  # the loop saved, said so, and stops (trainer/core/loop.py finish)
        print("preempted: stopped at step 3 with its checkpoint")
        raise SignalStop(signal.SIGTERM)
    if WINDOW == "a second signal":
        sigterm()
    if WINDOW == "an error":
        raise RuntimeError("a collective failed")
    if WINDOW == "atexit":
        atexit.register(sigterm)
    if WINDOW == "a __del__":
        collected = SignalsWhenCollected()
        del collected
        print("went on after the signal")


launch.main_guard(main)
"""
STOPPED = f"SIGTERM: stopped {BEFORE_THE_LOOP}"


@pytest.mark.parametrize("window,code,err", [
    ("installed", 143, STOPPED),  # the handlers are in place, main_guard's try not yet entered
    ("refusal", 143, STOPPED),  # a ConfigError's report begins
    ("the loop's stop", 143, ""),  # the loop's own SignalStop (its line said) is reported: the second signal is silent
    ("a second signal", 143, STOPPED),  # the first signal's SignalStop is reported: its line once
    ("an error", 143, STOPPED),  # an error's report begins (a collective failed: a lost peer, as torchrun stops us)
    ("atexit", 0, ""),  # main() returned: the exit's code, silently (the prelude's "while loading" line before)
    ("a __del__", 143, STOPPED),  # raised where Python only prints "Exception ignored" and goes on
])
def test_a_signal_anywhere_in_main_guard_is_one_line_and_its_code(tmp_path, window, code, err):
    """SIGTERM at each moment main_guard passes through, one process: stderr is the one line (or nothing, where the
    loop said it or the run had finished) and the exit code the signal's (or the finished run's), never a traceback.
    Before: a traceback of SignalStop and exit 1 in the first five, the prelude's wrong line ("stopped while loading")
    and 143 at exit, and a signal in a __del__ lost (exit 0, the run went on)."""
    script = tmp_path / "window.py"
    script.write_text(WINDOW_SCRIPT.format(root=ROOT))
    run = forked(str(script), [window], timeout=120)
    assert (run.returncode, run.stderr.strip()) == (code, err), run.stderr[-3000:]
    assert "went on" not in run.stdout
