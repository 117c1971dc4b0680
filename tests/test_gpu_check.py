"""scripts/gpu_check.py --dry_run: the GPU check's plan runs end to end on CPU with tiny shapes."""
import json
import subprocess
import time

import pytest

from scripts import gpu_check
from scripts.benchmarks import gpu_quick as gpu_check_quick
from tests.helpers.launch import forked_argv

# the first loss of a bf16-autocast run against fp32 on the same weights: matmul operands rounded to bf16 (unit
# roundoff 2**-9 each, so ~2**-8 per product) perturb the logits by ~2**-8 of their magnitude, and CE moves by at most
# twice the largest logit error; at init the logits are small against the loss (~ln vocab), so 2**-7 of it bounds it
BF16_LOSS_BOUND = 2 ** -7


def forked_run(argv, log_path, timeout, env=None):
    """gpu_check.run with the trainer runs forked from this process (tests/helpers/launch.py forked): the same runs,
    without ~8 s of imports each."""
    start = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
    try:
        code = forked_argv(argv, log_path, timeout, env)
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
    # every row says the dtype it trained in: bf16 where this CPU computes it natively (else fp32, named so)
    dtype = gpu_check.dry_run_dtype()
    main = gpu_check.SHORT[dtype]
    assert rows[main]["dtype"] == rows["torchrun_1"]["dtype"] == dtype
    assert rows["moe_fp32_grad_ckpt"]["dtype"] == "float32"  # fp16 is refused on CPU
    # runs of one flag set and dtype compute the same thing, whatever else they do (a launcher, a profiler)
    assert rows[main]["losses"] == rows["torchrun_1"]["losses"] == rows["profiler"]["losses"]
    if dtype == "bfloat16":  # a real bf16 run: its first loss (same weights) is the fp32 run's within bf16 rounding
        bf16_loss, fp32_loss = rows[main]["losses"][0], rows["resume"]["straight_losses"][0]
        assert bf16_loss != fp32_loss and abs(bf16_loss - fp32_loss) <= BF16_LOSS_BOUND * fp32_loss
    # FlexAttention's document mask computes the dense mask's attention (fp32: a few ulp)
    assert rows["flex_doc_mask"]["max_error_vs_dense"] <= 1e-5
    assert (tmp_path / "gpu_check.md").read_text().count("| yes |") == report["passed"]


def test_refuses_without_cuda_or_unknown_sections(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--dry_run", "--sections", "smoke,nope", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --sections nope")


def test_quick_plan_runs_twice_in_one_folder(tmp_path, monkeypatch):
    """--quick --dry_run twice in the same --out (a warm GPU machine keeps the first check's outputs): the second
    check runs every item afresh and measures what the first measured. Losses: the same fp32 runs on the same CPU
    are bit-identical; the killed-and-resumed run's steps 3-4 equal the straight run's exactly."""
    monkeypatch.setattr(gpu_check, "run", forked_run)
    reports = []
    for _ in range(2):
        assert gpu_check.main(["--quick", "--dry_run", "--out", str(tmp_path)]) == 0
        reports.append({row["name"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())
                        ["sections"]["quick"]})
    first, second = reports
    assert set(first) == set(second) == {"m3_seq340_eager", "h768x16_seq2048_compile", "kill_resume"}
    for name in first:
        assert first[name]["ok"] and second[name]["ok"], (name, second[name].get("log_tail"))
    for name in ("m3_seq340_eager", "h768x16_seq2048_compile"):
        assert first[name]["final_loss"] == second[name]["final_loss"]
    resumed = second["kill_resume"]
    assert len(resumed["losses"]) == len(resumed["straight_losses"]) == 4
    assert resumed["losses"][2:] == resumed["straight_losses"][2:] == first["kill_resume"]["straight_losses"][2:]
    # the profiled config names its top operators (a CPU trace: operators; CUDA: kernels), shares in (0, 1]
    top = second["h768x16_seq2048_compile"]["top_kernels"]
    assert len(top) == gpu_check_quick.TOP_KERNELS and all(0 < share <= 1 for *_, share in top)
    assert sum(share for *_, share in top) <= 1 + 1e-9


def test_quick_refuses_unknown_items(tmp_path, capsys):
    assert gpu_check.main(["--quick", "--dry_run", "--out", str(tmp_path), "--only", "m3_seq340_eager,nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --only nope")
