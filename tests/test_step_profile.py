"""scripts/step_profile.py: the shares of a Chrome trace written here by hand (nested operators, another thread, an
operator outside the step), against the self times worked out in the comments."""
import json
import os
import subprocess
import sys

import pytest

from scripts.benchmarks.step_shares import step_shares
from tests.helpers.launch import ROOT


def event(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": "cpu_op"}


def test_self_times_go_to_the_outermost_region_else_the_nearest_kind(tmp_path):
    events = [event("ProfilerStep#4", 0, 100, tid=1),
              event("aten::linear", 0, 30), event("aten::mm", 1, 19),  # matmul: 3 self + 19
              event("aten::_to_copy", 20, 8), event("aten::copy_", 21, 6),  # under linear, yet a cast: 2 + 6
              event("aten::mul", 30, 10),  # elementwise: 10
              event("aten::scaled_dot_product_attention", 40, 10), event("aten::mm", 41, 4),  # attention: 6 + 4
              event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 50, 5),  # loader: 5
              event("_ChunkedHead", 55, 5), event("aten::mm", 56, 3),  # chunked loss: 2 + 3
              event("Optimizer.step#AdamW.step", 60, 20), event("aten::mul_", 62, 8),  # optimizer: 12 + 8
              event("aten::mm", 5, 50, tid=2),  # another thread: not the step's
              event("aten::mul", 120, 10)]  # after the step
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "i", "name": "marker", "ts": 3}]}))
    shares, steps, seconds = step_shares(str(path))
    matmul = (30 - 19 - 8) + 19  # linear's self time (less mm and _to_copy) + mm
    expected = {"matmul": matmul, "cast/copy": 8, "elementwise/other": 10, "attention": 10, "chunked loss": 5,
                "optimizer": 20, "loader": 5}
    expected["framework"] = 100 - sum(expected.values())  # the step's time no operator covers
    assert shares == pytest.approx({k: v / 100 for k, v in expected.items()}, abs=1e-12)
    assert (steps, seconds) == (1, 100e-6)


def test_a_trace_without_step_marks_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [event("aten::mm", 0, 5)]}))
    with pytest.raises(ValueError, match="no ProfilerStep# marks"):
        step_shares(str(path))


def test_the_command_names_its_argument_and_refuses_what_is_not_a_trace(tmp_path):
    script = os.path.join(ROOT, "scripts", "step_profile.py")

    def run(*args):
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)

    helped = run("--help")
    assert helped.returncode == 0 and "--profile_steps" in helped.stdout  # --help is help, not a trace path
    missing = run(str(tmp_path / "none.json"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot read ")
    assert "Traceback" not in missing.stderr
    (tmp_path / "bad.json").write_text("{not json")
    bad = run(str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
