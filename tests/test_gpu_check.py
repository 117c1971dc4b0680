"""scripts/gpu_check.py --dry_run: the GPU check's plan runs end to end on CPU with tiny shapes."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def test_dry_run_report(tmp_path):
    # the cuda-marked tests run in this suite already, and tests/test_bench.py runs bench.py: the dry run covers the
    # rest of the plan
    proc = subprocess.run([sys.executable, SCRIPT, "--dry_run", "--out", str(tmp_path), "--sections",
                           "smoke,attention"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
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


def test_refuses_without_cuda_or_unknown_sections(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--dry_run", "--sections", "smoke,nope", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --sections nope")
