"""The suite's own guards (pytest.ini, tests/conftest.py) on a session of its own: a failure's lines print as it
happens, a passing test's tmp_path is removed and a failing one's kept, and a session past suite_deadline_minutes
stops after the running test with exit 1."""
import os
import subprocess
import sys

from tests.helpers.launch import ROOT

TESTS = '''
def test_a_passes(tmp_path):
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))


def test_b_fails(tmp_path):
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))
    assert 1 + 1 == 3, "b's own message"


def test_c_passes():
    pass
'''


def run_session(tmp_path, *options):
    (tmp_path / "test_three.py").write_text(TESTS)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-c", os.path.join(ROOT, "pytest.ini"),
           "--rootdir", ROOT, "--basetemp", str(tmp_path / "base"), *options, str(tmp_path / "test_three.py")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_failure_prints_at_once_and_only_its_tmp_path_stays(tmp_path):
    proc = run_session(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "1 failed, 2 passed" in out
    early = out.index("test_b_fails failed after")
    assert early < out.index("= FAILURES =")  # before the summary, which a killed run never prints
    assert "b's own message" in out[early:out.index("= FAILURES =")]
    kept = [name for name in os.listdir(tmp_path / "base") if not os.path.islink(tmp_path / "base" / name)]
    assert [name for name in kept if name.startswith("test_")] == ["test_b_fails0"]


def test_past_the_deadline_the_session_stops_after_the_running_test(tmp_path):
    proc = run_session(tmp_path, "-o", "suite_deadline_minutes=0.0001")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed in" in proc.stdout  # test_a_passes ran; b and c did not
    assert "the session ran past suite_deadline_minutes (0.0001 min" in proc.stdout
