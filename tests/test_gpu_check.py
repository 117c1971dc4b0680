"""scripts/gpu_check.py --dry_run: the GPU check's plan runs end to end on CPU with tiny shapes."""
import json
import subprocess
import time

import pytest

from scripts import gpu_check
from tests.launch import forked_argv


def forked_run(argv, log_path, timeout):
    """gpu_check.run with the trainer runs forked from this process (tests/launch.py forked): the same runs,
    without ~8 s of imports each."""
    start = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
    try:
        code = forked_argv(argv, log_path, timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
    with open(log_path, errors="replace") as log:
        tail = log.read()[-1500:]
    return code, round(time.time() - start, 1), tail


def test_dry_run_report(tmp_path, monkeypatch):
    # the cuda-marked tests run in this suite already, and tests/test_bench.py runs bench.py: the dry run covers the
    # rest of the plan
    monkeypatch.setattr(gpu_check, "run", forked_run)
    assert gpu_check.main(["--dry_run", "--out", str(tmp_path), "--sections", "smoke,attention"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["name"]: row for section in report["sections"].values() for row in section}
    assert report["failed"] == 0 and set(report["sections"]) == {"smoke", "attention"}
    # the resumed run continues the straight run's losses exactly (fp32, CPU, same layout)
    assert rows["resume"]["losses"] == rows["resume"]["straight_losses"]
    # the fp32 runs of one flag set learn the same thing: doc mask on and off differ only where rows hold documents
    assert rows["bf16"]["losses"] == rows["torchrun_1"]["losses"] == rows["profiler"]["losses"]
    # FlexAttention's document mask computes the dense mask's attention (fp32: a few ulp)
    assert rows["flex_doc_mask"]["max_error_vs_dense"] <= 1e-5
    assert (tmp_path / "gpu_check.md").read_text().count("| yes |") == report["passed"]


def test_refuses_without_cuda_or_unknown_sections(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--dry_run", "--sections", "smoke,nope", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --sections nope")
