"""The CPU's bf16 probe for tests: forced one way where the code reads it (tests/conftest.py's --cpu-bf16 for a whole
session, force_cpu_bf16 for one test), and a CPU-rate cache of the session's own, so the suite passes whichever way a
CPU answers and never reads the user's cache (~/.cache/minimind4d)."""
import json
import os
import sys

import torch

from model import torch_compat
from trainer.observe import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# mode: (native bf16, the cached bf16 autocast rate over fp32's): "faster"/"slower" put --dtype auto's choice on either
# side of checks.BF16_MARGIN; "absent" is an AVX2 CPU (no bf16 unit: auto takes fp32, --dtype bfloat16 is refused)
MODES = {"real": (None, None), "faster": (True, 2.0), "slower": (True, 0.5), "absent": (False, 0.5)}
REAL_PROBE = torch_compat.cpu_bf16_native


def patch_probe(monkeypatch, native):
    """cpu_bf16_native() answers `native`: in model/torch_compat.py and in every module of this repository that
    imported it by name (trainer/observe/metrics.py, which checks.py reads, scripts/gpu_check.py); modules imported
    later take torch_compat's."""
    def probe():
        return native
    probe.forced = True  # a later patch (one test's, over the session's) finds it as it finds the real one
    for module in list(sys.modules.values()):
        found = getattr(module, "cpu_bf16_native", None) if (getattr(module, "__file__", None) or "").startswith(
            ROOT) else None
        if found is REAL_PROBE or getattr(found, "forced", False):
            monkeypatch.setattr(module, "cpu_bf16_native", probe)


def seeded_entry(measured, mode):
    """The cache entry of a CPU of `mode` from a measurement here: quiet (one measurement per session, whatever the
    load: the session's own cache), and for a forced mode bf16 autocast at MODES' ratio to the measured fp32 rate;
    the bf16 peak stays the measured one where the measurement took one (an MFU's denominator, not a decision)."""
    entry = dict(measured, quiet=True)
    ratio = MODES[mode][1]
    if ratio is not None:
        forced = ratio * measured["float32"]
        entry.update(bfloat16_autocast=forced, bfloat16=measured.get("bfloat16", forced))
    return entry


def seed_rates(path, mode, thread_counts):
    """Write `path` (a rates cache, metrics.RATES_FILE's format) with one seeded entry per thread count: processes
    started from the tests (one thread each) read it instead of measuring (~1 s each, hundreds of launches)."""
    entries, threads = {}, torch.get_num_threads()
    try:
        for count in sorted(set(thread_counts)):
            torch.set_num_threads(count)
            entries[metrics.cpu_rates_key()] = seeded_entry(metrics.measure_cpu_rates(), mode)
    finally:
        torch.set_num_threads(threads)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    return entries


def force_cpu_bf16(monkeypatch, mode, fp32_rate=1e11):
    """This process's probe and rates as a CPU of `mode` answers them (not "real"), without measuring: cpu_bf16_native
    and cpu_matmul_rates' entry for this process's key (fp32 at `fp32_rate`)."""
    native, _ = MODES[mode]
    patch_probe(monkeypatch, native)
    entry = seeded_entry({"float32": fp32_rate}, mode)
    monkeypatch.setattr(metrics, "_PEAK_CACHE", {metrics.cpu_rates_key(): dict(entry, provisional=False)})
