"""trainer/base/prelude.py: an entry script says what it is loading before its heavy imports, and a signal during
those imports is one line and exit 128 + signum (no traceback), in a fresh interpreter as a user starts it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT


@pytest.mark.parametrize("script, what, sig", [
    ("trainer/train_sft.py", "torch, transformers and the trainer", signal.SIGINT),
    ("trainer/train_dpo.py", "torch, transformers and the trainer", signal.SIGTERM),
    ("scripts/eval_llm.py", "torch, transformers and the model", signal.SIGINT),
    ("scripts/convert_model.py", "torch, transformers and the converters", signal.SIGTERM),
])
def test_the_first_line_comes_before_the_imports_and_a_signal_there_is_one_line(script, what, sig):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, script, "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        seconds = time.monotonic() - start
        # torch alone takes over a second to import: the signal lands inside the imports the line announced
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first == f"{script}: loading {what} ...\n", (first, out, err)
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    assert err == f"{sig.name}: stopped while loading {what}; nothing was started\n"
    assert out == ""  # --help was never reached
    print(f"{script}: first line after {seconds:.2f} s")
