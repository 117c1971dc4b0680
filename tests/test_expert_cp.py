"""Expert parallel composed with context parallel (trainer/parallel/expert.py under parallel/context.py): `--ep 2
--cp 2` on 4 real gloo processes (ep carved out of dp 2; each rank holds half of every sequence, head + tail chunks,
and dispatches its own tokens to the experts; the ep groups join the ranks at the same cp coordinate, and each
expert's replicas, the cp peers, sum its gradients) computes what the single process computes."""
import os

import pytest

from tests.helpers.launch import forked, read_metrics
from tests.helpers.layouts import SCRIPT, STEPS, assert_same_run, run_args, run_layout


def test_ep2_cp2_training_run_equals_one_process(data, reference, tmp_path):  # noqa: F811 (test_layouts' fixtures)
    """Every step's loss, aux loss (cp-wide router statistics), tokens and gradient norm (the experts' gradients: all
    tokens' share once, divided by the dp*cp loss scale) equal the single process's (the norm within the harness's
    loss bound: the same trajectory); the gathered weights are the run's checkpoint; one process resumed from its
    step-4 checkpoint takes the layout's last step (tests/test_layouts.assert_same_run). Packed rows, --doc_mask 1
    (test_layouts' default): the ring masks each document."""
    workdir = run_layout(tmp_path, data, "moe", 4, ["--ep", "2", "--cp", "2"], ["--max_steps", str(STEPS)])
    records = read_metrics(os.path.join(workdir, "m.jsonl"))
    for got, want in zip(records, reference["moe"]):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got["step"], got, want)
    assert_same_run(workdir, data, "moe", reference["moe"])


def test_ep_is_not_carved_out_of_cp(data, tmp_path):  # noqa: F811
    """ep is carved out of the dp ranks only (the cp ranks share samples, not experts): --ep 2 --cp 2 on 2 processes
    (dp 1) is one `error:` line, exit 2, before any collective."""
    args = [*run_args(str(tmp_path), data, "moe", 1), "--ep", "2", "--cp", "2"]
    proc = forked(SCRIPT, args, 2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "--ep 2 must divide the data-parallel size (1)" in errors[0]
