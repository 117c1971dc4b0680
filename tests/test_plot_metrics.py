"""scripts/plot_metrics.py on real trainer runs' metrics files: the plotted lines are the files' values, PNG out."""
import json
import os
import shutil

import pytest
from matplotlib.image import imread

from scripts.plot_metrics import load_metrics, plot
from tests.helpers.disks import fill
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked

SCRIPT = "scripts/plot_metrics.py"
LOADING = "scripts/plot_metrics.py: loading pandas and matplotlib ...\n"  # trainer/base/prelude.py's first line


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real tiny pretraining runs (two learning rates) with validation every 2 steps: their metrics files."""
    tmp = tmp_path_factory.mktemp("runs")
    data = demo_slice(tmp, "pretrain", 64)
    paths = []
    for lr in ("5e-4", "3e-3"):
        out = os.path.join(str(tmp), f"lr{lr}")
        metrics = os.path.join(out, "metrics.jsonl")
        proc = forked("trainer/train_pretrain.py", [
            *TINY_MODEL, "--max_steps", "4", "--batch_size", "4", "--accumulation_steps", "1", "--max_seq_len", "32",
            "--log_interval", "1", "--learning_rate", lr, "--data_path", data, "--eval_data_path", data,
            "--eval_interval", "2", "--eval_batches", "2", "--metrics_file", metrics, "--save_dir", out,
            "--checkpoint_dir", os.path.join(out, "ckpt")], timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        paths.append(metrics)
    return paths


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def lines_by_panel(fig):
    """{panel title: {legend label: (x list, y list)}} read back from the figure's artists."""
    return {ax.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
            for ax in fig.axes if ax.get_visible()}


def test_plotted_lines_are_the_files_values(runs):
    fig = plot([load_metrics(p) for p in runs], ["lr 5e-4", "lr 3e-3"])
    panels = lines_by_panel(fig)
    assert list(panels) == ["loss", "eval loss", "bits per byte (eval)", "learning rate", "gradient norm", "tokens/s",
                            "MFU", "peak memory"]
    for path, label in zip(runs, ["lr 5e-4", "lr 3e-3"]):
        records = read_records(path)
        train = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
        assert panels["loss"][label] == ([1, 2, 3, 4], [r["loss"] for r in train])
        assert panels["eval loss"][label] == ([2, 4], [r["eval_loss"] for r in evals])
        assert panels["bits per byte (eval)"][label] == ([2, 4], [r["eval_bpb"] for r in evals])
        assert panels["learning rate"][label][1] == [r["lr"] for r in train]
        assert panels["gradient norm"][label][1] == [r["grad_norm"] for r in train]
        assert panels["tokens/s"][label][1] == [r["tokens_per_sec"] for r in train]
        assert panels["MFU"][label][1] == [r["mfu"] * 100 for r in train]  # drawn in percent
        assert panels["peak memory"][label][1] == [r["peak_mem_gb"] for r in train]
    assert panels["learning rate"]["lr 3e-3"][1][0] == 3e-3  # each file keeps its own line


def test_cli_writes_a_png_of_the_documented_size(runs, tmp_path):
    out = tmp_path / "plots" / "compare.png"
    proc = forked(SCRIPT, [*runs, "--labels", "slow,fast", "--out", out, "--dpi", "50"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{LOADING}wrote {out}\n"
    height, width, channels = imread(out).shape  # decodes the whole PNG
    assert (width, height, channels) == (900, 320, 4)  # 8 panels: 4 columns x 2 rows of 4.5 x 3.2 inches at 50 dpi


def test_default_output_is_under_the_repos_out_and_named(runs, tmp_path):
    """Without --out the PNG goes to out/<first file's name>.png in the repository (from any directory), and the
    script says where."""
    metrics = tmp_path / f"plot_default_test_{os.getpid()}.jsonl"  # a name no user file has
    shutil.copy(runs[0], metrics)
    out = os.path.join(ROOT, "out", metrics.stem + ".png")
    try:
        proc = forked(SCRIPT, [metrics, "--dpi", "20"], timeout=120, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"{LOADING}wrote {out}\n" and imread(out).shape[2] == 4
        assert not [name for name in os.listdir(tmp_path) if name.endswith(".png")]  # none in the working directory
    finally:
        if os.path.exists(out):
            os.remove(out)


def test_panels_without_data_are_left_out_and_repeated_steps_keep_the_last(tmp_path):
    path = tmp_path / "resumed.jsonl"
    records = [dict(step=1, loss=9.0, lr=1e-3), dict(step=2, loss=8.0, lr=1e-3),
               dict(step=2, loss=7.5, lr=1e-3), dict(step=3, loss=7.0, lr=9e-4)]  # step 2 logged again after a resume
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    panels = lines_by_panel(plot([load_metrics(path)], ["run"]))
    assert list(panels) == ["loss", "learning rate"]
    assert panels["loss"]["run"] == ([1, 2, 3], [9.0, 7.5, 7.0])


@pytest.mark.parametrize("content, extra, needle", [
    (None, [], "not found"),
    ("", [], "not a metrics JSONL"),
    ('{"step": 1, "loss": 9.0}\nnot json\n', [], "line 2 is not JSON"),
    ('{"step": 1, "loss": 9.0}\n', ["--labels", "a,b"], "one per file"),
    ('{"step": 1, "tokens": 10}\n', [], "no plottable metrics"),
])
def test_bad_files_are_one_error_line_and_exit_2(tmp_path, content, extra, needle):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    proc = forked(SCRIPT, [path, "--out", tmp_path / "p.png", *extra], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "p.png")


def test_a_full_disk_is_one_line_and_the_earlier_image_stays(runs, small_disk):  # noqa: F811
    """A PNG is written whole or not at all: on a full disk the script says so in one line (exit 3), the image of the
    earlier call is still there, byte for byte, and no temporary file is left."""
    disk = small_disk(1)
    out = os.path.join(disk, "loss.png")
    assert forked(SCRIPT, [runs[0], "--out", out, "--dpi", "20"], timeout=120).returncode == 0
    before = open(out, "rb").read()
    fill(disk)
    proc = forked(SCRIPT, [*runs, "--out", out, "--dpi", "60"], timeout=120)
    assert proc.returncode == 3 and proc.stderr == (f"error: disk full writing {out} (No space left on device); the "
                                                    "image there is as it was; free space or choose another --out\n")
    assert open(out, "rb").read() == before and sorted(os.listdir(disk)) == ["filler", "loss.png"]


def test_moe_load_is_one_line_per_layer(tmp_path):
    records = [{"step": s, "loss": 5.0 - s, f"expert_load_cv/layer{i}": 0.1 * s + i, f"expert_tokens_min/layer{i}": s}
               for s in (1, 2) for i in (0,)]
    for record, cv in zip(records, (0.7, 0.9)):
        record.update({"expert_load_cv/layer1": cv, "expert_tokens_min/layer1": 0})
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    panels = lines_by_panel(plot([load_metrics(str(path))], ["moe"]))
    assert panels["MoE expert load"] == {"moe layer0": ([1, 2], [0.1, 0.2]), "moe layer1": ([1, 2], [0.7, 0.9])}
    assert panels["MoE least-loaded expert"] == {"moe layer0": ([1, 2], [1, 2]), "moe layer1": ([1, 2], [0, 0])}
