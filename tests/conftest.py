"""Test markers: `slow` = starts processes (set here on every test that does; runs in .ci/run);
`huge` = needs RUN_SLOW=1 (nothing in the suite is so marked today: the 16-process layout runs in CI)."""
import dis
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch
import tqdm
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# tests fork trainers from this process: no tqdm monitor thread here, whose lock a fork could copy while held
tqdm.tqdm.monitor_interval = 0

from tests.helpers import launch  # noqa: E402  (after the repo root is on sys.path)
from tests.helpers.cpu_probe import MODES, patch_probe, seed_rates  # noqa: E402
from tests.helpers.disks import no_small_disk  # noqa: E402
from tests.helpers.launch import demo_slice, forked, read_metrics  # noqa: E402
from tests.helpers.layouts import MODELS, REFERENCE_TIMEOUT, SCRIPT, STEPS, run_args  # noqa: E402
from trainer.observe import metrics  # noqa: E402

# the ways a test starts another process: the helpers of tests/helpers/launch.py, subprocess, multiprocessing
LAUNCHERS = (launch.spawn, launch.torchrun, launch.python, launch.forked, launch.start_forked, subprocess.run,
             subprocess.Popen, subprocess.call, subprocess.check_call, subprocess.check_output)
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output", "start_processes", "spawn"}
LAUNCH_HELPERS = {"spawn", "torchrun", "python", "forked"}  # tests/helpers/launch.py's, imported in a test's body
# torch.compile on CPU runs the C++ compiler in worker processes (tens of seconds on 2 cores)
COMPILERS = (torch.compile,)


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """main_guard ends its process and leaves its own signal handlers and unraisable hook for the exit: a test that runs
    it in this process gets this process's back."""
    handlers, hook = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}, sys.unraisablehook
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    sys.unraisablehook = hook


def pytest_addoption(parser):
    parser.addini("suite_deadline_minutes", "stop the session after the running test once it has run this long",
                  default="0")
    parser.addoption("--cpu-bf16", choices=sorted(MODES), default="real",
                     help="the CPU's bf16 probe for this session, forced where the code reads it: faster (native bf16, "
                     "--dtype auto takes it), slower (native, auto takes fp32), absent (an AVX2 CPU); real: this CPU's "
                     "(tests/helpers/cpu_probe.py)")


def pytest_configure(config):
    """--cpu-bf16 forced before collection: a test module that reads the probe at import sees the forced answer."""
    native = MODES[config.getoption("--cpu-bf16")][0]
    config.cpu_probe_patch = pytest.MonkeyPatch()
    if native is not None:
        patch_probe(config.cpu_probe_patch, native)


def pytest_unconfigure(config):
    config.cpu_probe_patch.undo()


_SESSION = {}  # the running session, when it started and its deadline in minutes (pytest_sessionstart)


def pytest_sessionstart(session):
    _SESSION.update(session=session, started=time.monotonic(),
                    minutes=float(session.config.getini("suite_deadline_minutes")))


def pytest_runtest_logreport(report):
    """A failure's last lines as it happens (the summary comes only at the session's end, which a run killed by
    CI's clock never reaches), and the stop once the session is past pytest.ini's suite_deadline_minutes."""
    session = _SESSION.get("session")
    if session is None:
        return
    if report.failed:
        tail = "\n".join(report.longreprtext.splitlines()[-12:])
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"\n{report.when} of {report.nodeid} failed after {report.duration:.0f} s:\n{tail}")
    minutes = _SESSION["minutes"]
    if report.when == "teardown" and 0 < minutes < (time.monotonic() - _SESSION["started"]) / 60:
        session.shouldfail = (f"the session ran past suite_deadline_minutes ({minutes:g} min, pytest.ini): stopped "
                              "after this test; the tests not reached did not run")


@pytest.fixture(scope="session", autouse=True)
def cpu_rates_cache(tmp_path_factory, pytestconfig):
    """The session's own CPU-rate cache: XDG_CACHE_HOME (read by every process a test starts) and metrics.RATES_FILE
    (computed at import) in a temporary folder, seeded with one measurement (as --cpu-bf16 says) for one thread (what
    tests/helpers/launch.py gives a process) and this process's threads; the user's ~/.cache/minimind4d is never
    read."""
    patch, cache = pytest.MonkeyPatch(), tmp_path_factory.mktemp("xdg_cache")
    path = str(cache / "minimind4d" / os.path.basename(metrics.RATES_FILE))
    patch.setenv("XDG_CACHE_HOME", str(cache))
    patch.setattr(metrics, "RATES_FILE", path)
    patch.setattr(metrics, "_PEAK_CACHE", {})
    seed_rates(path, pytestconfig.getoption("--cpu-bf16"), (1, torch.get_num_threads()))
    yield path
    patch.undo()


@pytest.fixture(scope="session")
def tokenizer():
    """The repo's real tokenizer (model/tokenizer.json), loaded once per test session."""
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


@functools.cache  # a function of the code object alone; the marking pass asks again for every test that reaches it
def calls_torch_compile(code):
    """`code` reads a `compile` attribute (torch.compile, nn.Module.compile) of anything but the re module."""
    if "compile" not in code.co_names:  # LOAD_ATTR / LOAD_METHOD take their name from co_names
        return False
    previous = None
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval == "compile" and not (
                previous is not None and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME") and previous.argval == "re"):
            return True
        previous = instruction
    return False


def launches(code, namespace, seen):
    """Whether `code` (or a function of this repository it calls, transitively) starts a process."""
    if code in seen:
        return False
    seen.add(code)
    names = set(code.co_names)
    helper_call = "tests.helpers.launch" in names and LAUNCH_HELPERS & names
    if helper_call or ("subprocess" in names and SUBPROCESS_CALLS & names):
        return True  # imported inside the function
    if namespace.get("torch") is torch and calls_torch_compile(code):
        return True
    for name in code.co_names:
        obj = namespace.get(name)
        if any(obj is launcher for launcher in LAUNCHERS + COMPILERS):
            return True
        if isinstance(obj, types.ModuleType) and obj.__name__ in ("subprocess", "torch.multiprocessing",
                                                                  "multiprocessing"):
            if SUBPROCESS_CALLS & set(code.co_names):
                return True
        if isinstance(obj, types.FunctionType) and obj.__code__.co_filename.startswith(ROOT):  # the repo's code
            if launches(obj.__code__, obj.__globals__, seen):
                return True
    # lambdas and nested functions of this code object
    return any(launches(c, namespace, seen) for c in code.co_consts if isinstance(c, types.CodeType))


def item_launches(item):
    """The test function or any fixture it uses (its own or conftest's) starts a process."""
    seen = set()
    functions = [item.function]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        functions += [d.func for d in defs]
    return any(launches(f.__code__, f.__globals__, seen) for f in functions if hasattr(f, "__code__"))


def pytest_collection_modifyitems(config, items):
    run_huge = os.environ.get("RUN_SLOW") == "1"
    for item in items:
        if item.get_closest_marker("huge") is not None and not run_huge:
            item.add_marker(pytest.mark.skip(reason="marked huge; set RUN_SLOW=1"))
        if item_launches(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs of the given size under tmp_path; unmounted afterwards."""
    mounted = []

    def mount(size_mib):
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(disk)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            no_small_disk(result.stderr.strip())
        mounted.append(disk)
        return str(disk)

    yield mount
    for disk in mounted:
        subprocess.run(["umount", str(disk)], check=True)


# session scope: test_layouts and the four test_expert* modules compare with the same read-only runs (once, not 5x)
@pytest.fixture(scope="session")
def data(tmp_path_factory):
    return demo_slice(tmp_path_factory.mktemp("data"), "pretrain", 160)


@pytest.fixture(scope="session")
def reference(data, tmp_path_factory):
    """Single-process runs (the definition of correct), one per model."""
    refs = {}
    for model in MODELS:
        workdir = str(tmp_path_factory.mktemp(f"ref_{model}"))
        proc = forked(SCRIPT, run_args(workdir, data, model, 1, ["--max_steps", str(STEPS)]), timeout=REFERENCE_TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        refs[model] = read_metrics(os.path.join(workdir, "m.jsonl"))
    return refs


@pytest.fixture
def offline(monkeypatch):
    """No connection leaves the machine: any socket connect other than loopback or a unix socket fails the test."""
    real_connect = socket.socket.connect

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host not in (None, "127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access to {address} during an offline test")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
