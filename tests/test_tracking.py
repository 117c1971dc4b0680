"""Tracker sinks read back with their own libraries (JSONL, TensorBoard events, swanlab run files); StepProfiler."""
import glob
import json
import os
import re

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.disks import fill
from trainer.ckpt.storage import DiskFullError
from trainer.observe.step_profiler import StepProfiler, parse_profile_steps
from trainer.observe.tracking import Tracker, truncate_metrics


def train_record(step, loss):
    """A training record shaped like the trainer's (two ranks)."""
    return dict(step=step, epoch=0, loss=loss, aux_loss=0.0, lr=5e-4 / step, tokens=124 * step,
                tokens_per_sec=3000.0 + step, mfu=0.1 + step / 100, peak_mem_gb=0.42 + step / 1000,
                peak_mem_gb_per_rank=[0.41 + step / 1000, 0.42 + step / 1000], elapsed_s=0.04 * step)


def eval_record(step, loss):
    return dict(step=step, eval_loss=loss, eval_ppl=float(np.exp(loss)))


def after_resume(old, resumed):
    """The records a reader should see after a resume: the first run's up to the resume step, then the new ones."""
    resumed_steps = {r["step"] for r in resumed}
    return {r["step"]: r for r in old if r["step"] not in resumed_steps} | {r["step"]: r for r in resumed}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_records_and_console_line(tmp_path, capsys):
    records = [train_record(1, 8.7625303), eval_record(1, 8.75), train_record(2, 8.7586021)]
    tracker = Tracker(tmp_path / "m.jsonl")
    for r in records:
        tracker.log(r)
    assert read_jsonl(tmp_path / "m.jsonl") == records  # flushed while the tracker is still open
    tracker.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("step 1 | epoch 0 | loss 8.762530 | aux_loss 0.000000 | lr 5.000e-04 | tokens/s 3001 "
                        "| mfu 11.0% | mem 0.42GiB")
    assert lines[1] == "step 1 | eval_loss 8.7500 | ppl 6310.69"
    assert len(lines) == 3


def test_truncate_metrics_keeps_steps_up_to_n(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [train_record(s, 9.0 - s) for s in range(1, 6)] + [eval_record(2, 8.0), eval_record(4, 7.0)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write('{"step": 6, "loss": 3.')  # a crash mid-write
    truncate_metrics(str(path), 3)
    assert read_jsonl(path) == [r for r in records if r["step"] <= 3]
    truncate_metrics(str(tmp_path / "absent.jsonl"), 3)  # a fresh run has no file yet
    assert not os.path.exists(tmp_path / "absent.jsonl")


def test_only_the_main_process_writes(tmp_path):
    tracker = Tracker(tmp_path / "m.jsonl", is_main=False, tensorboard_dir=tmp_path / "tb", use_wandb=True,
                      resume_id="abc123")
    tracker.log(train_record(1, 9.0))
    tracker.close()
    assert os.listdir(tmp_path) == []
    assert tracker.run_id == "abc123"  # non-main ranks keep the checkpoint's id unchanged


def test_tensorboard_scalars_every_step_and_per_rank_after_resume(tmp_path):
    first = [train_record(s, 9.0 - s / 10) for s in range(1, 5)] + [eval_record(2, 8.5), eval_record(4, 8.4)]
    tracker = Tracker(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"), console=False)
    for r in first:
        tracker.log(r)
    tracker.close()
    # the run crashed after step 4 and resumes from its step-2 checkpoint: steps 3-4 run again with new values
    resumed = [train_record(s, 7.0 - s / 10) for s in (3, 4)] + [eval_record(4, 8.1)]
    tracker = Tracker(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"), console=False, resume_step=2)
    for r in resumed:
        tracker.log(r)
    tracker.close()

    train = after_resume([r for r in first if "loss" in r], [r for r in resumed if "loss" in r])
    evals = after_resume([r for r in first if "eval_loss" in r], [r for r in resumed if "eval_loss" in r])
    assert read_jsonl(tmp_path / "m.jsonl") == [r for r in first if r["step"] <= 2] + resumed

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    expected = {name: {s: r[name] for s, r in train.items()}
                for name in ("loss", "aux_loss", "lr", "tokens", "tokens_per_sec", "mfu", "peak_mem_gb", "elapsed_s")}
    for rank in (0, 1):
        expected[f"peak_mem_gb_per_rank/rank{rank}"] = {s: r["peak_mem_gb_per_rank"][rank] for s, r in train.items()}
    expected["eval_loss"] = {s: r["eval_loss"] for s, r in evals.items()}
    expected["eval_ppl"] = {s: r["eval_ppl"] for s, r in evals.items()}
    assert set(events.Tags()["scalars"]) == set(expected) | {"epoch"}
    for name, by_step in expected.items():
        got = {e.step: e.value for e in events.Scalars(name)}
        # TensorBoard stores float32: the logged value rounded once, exactly
        assert got == {s: float(np.float32(v)) for s, v in by_step.items()}, name


def read_swanlab_scalars(run_dir):
    """{key: {step: value}} from a swanlab run's record file (the same reader `swanlab sync` uses)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader
    reader = DataStoreReader()
    reader.open(glob.glob(os.path.join(run_dir, "run-*.swanlab"))[0])
    scalars = {}
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.HasField("scalar"):
            scalars.setdefault(record.scalar.key, {})[record.scalar.step] = record.scalar.value.number
    reader.close()
    return scalars


def test_swanlab_offline_run_and_resume_continue_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)  # as in CI: not logged in, no TTY
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "no_login"))  # no saved `swanlab login` either
    monkeypatch.chdir(tmp_path)  # nor a project-level .swanlab/.netrc
    first = [train_record(s, 9.0 - s / 10) for s in (1, 2, 3)] + [eval_record(3, 8.6)]
    tracker = Tracker(tmp_path / "m.jsonl", use_wandb=True, wandb_project="MiniMind-test", console=False,
                      config={"hidden_size": 64, "dtype": torch.float32})
    for r in first:
        tracker.log(r)
    tracker.close()
    run_id = tracker.run_id
    assert run_id
    resumed = [train_record(s, 7.0 - s / 10) for s in (4, 5)]
    tracker = Tracker(tmp_path / "m.jsonl", use_wandb=True, wandb_project="MiniMind-test", console=False,
                      resume_id=run_id, resume_step=3)
    for r in resumed:
        tracker.log(r)
    tracker.close()
    assert tracker.run_id == run_id

    run_dirs = sorted(glob.glob(str(tmp_path / "swanlog" / f"run-*-{run_id}")))
    assert len(run_dirs) == 2  # one local directory per process lifetime, both under the same run id
    for run_dir, records in zip(run_dirs, (first, resumed)):
        got = read_swanlab_scalars(run_dir)
        train = [r for r in records if "loss" in r]
        assert got["loss"] == {r["step"]: r["loss"] for r in train}
        assert got["lr"] == {r["step"]: r["lr"] for r in train}
        for rank in (0, 1):
            expected = {r["step"]: r["peak_mem_gb_per_rank"][rank] for r in train}
            assert got[f"peak_mem_gb_per_rank/rank{rank}"] == expected
    assert read_swanlab_scalars(run_dirs[0])["eval_loss"] == {3: 8.6}


@pytest.mark.parametrize("spec", ["5:3", "x", "3", "0:2", "1:2:3", "a:b"])
def test_bad_profile_steps_name_the_flag(spec):
    with pytest.raises(ValueError, match="--profile_steps") as error:
        StepProfiler(spec, "unused", "cpu")
    assert "\n" not in str(error.value)


def test_profile_steps_parse():
    assert parse_profile_steps("5:7") == (5, 7)
    assert parse_profile_steps("3:3") == (3, 3)


def run_profiled(out_dir, spec, start_step, last_step):
    """Optimizer steps start_step+1..last_step of a tiny model, with a StepProfiler; returns the trace events."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiler = StepProfiler(spec, str(out_dir), "cpu")
    for step in range(start_step + 1, last_step + 1):
        profiler.begin(step)
        ids = torch.randint(0, config.vocab_size, (2, 32))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    profiler.close()
    traces = glob.glob(os.path.join(out_dir, "rank0.*.pt.trace.json"))
    assert len(traces) == 1
    with open(traces[0]) as f:
        return json.load(f)["traceEvents"]


def profiled_steps(events):
    marks = sorted(int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#"))
    optimizer_steps = [e for e in events if e.get("name") == "Optimizer.step#AdamW.step"]
    return marks, optimizer_steps


def test_step_profiler_traces_only_the_requested_steps(tmp_path):
    events = run_profiled(tmp_path / "a", "2:3", start_step=0, last_step=5)
    marks, optimizer_steps = profiled_steps(events)
    assert marks == [2, 3]
    assert len(optimizer_steps) == 2  # steps 1, 4, 5 left out
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert all(any(a <= e["ts"] <= b for a, b in windows) for e in optimizer_steps)
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory is on
    # a run resumed from step 2 profiles what is left of 2:4, from its first step
    marks, optimizer_steps = profiled_steps(run_profiled(tmp_path / "b", "2:4", start_step=2, last_step=5))
    assert marks == [3, 4] and len(optimizer_steps) == 2
    # a run that stops inside A..B (max_steps) marks only the steps it ran
    marks, optimizer_steps = profiled_steps(run_profiled(tmp_path / "c", "2:4", start_step=0, last_step=2))
    assert marks == [2] and len(optimizer_steps) == 1


def test_step_profiler_off_writes_nothing(tmp_path):
    profiler = StepProfiler(None, str(tmp_path / "p"), "cpu")
    for step in range(1, 4):
        profiler.begin(step)
    profiler.close()
    assert not os.path.exists(tmp_path / "p")


def test_trainer_run_writes_every_sink_and_a_resume_continues_them(tmp_path, monkeypatch):
    """The real trainer with --tensorboard_dir, --use_wandb (no login: offline) and --profile_steps, stopped at
    step 2 and resumed to 4: every sink holds each step once, with the values of the metrics file."""
    from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
    data = demo_slice(tmp_path, "pretrain", 48)
    out, tb = tmp_path / "out", tmp_path / "tb"
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)  # as in CI: not logged in, no TTY
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    env = dict(SWANLAB_ROOT=str(tmp_path / "no_login"))  # no saved `swanlab login` either
    common = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps", "1",
              "--log_interval", "1", "--save_interval", "1", "--save_dir", str(out), "--checkpoint_dir",
              str(tmp_path / "ckpt"), "--tensorboard_dir", str(tb), "--use_wandb", "--profile_steps", "2:3"]
    for extra in (["--max_steps", "2"], ["--max_steps", "4", "--from_resume", "1"]):
        proc = forked("trainer/train_pretrain.py", common + extra, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_metrics(str(out / "pretrain_64_metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the resumed run appended, once per step
    loss = {r["step"]: r["loss"] for r in records}

    events = EventAccumulator(str(tb))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("loss")} == {s: float(np.float32(v)) for s, v in loss.items()}
    assert [e.step for e in events.Scalars("peak_mem_gb_per_rank/rank0")] == [1, 2, 3, 4]

    run_dirs = sorted(glob.glob(str(out / "swanlog" / "run-*")))
    assert len(run_dirs) == 2 and len({d.rsplit("-", 1)[1] for d in run_dirs}) == 1  # one swanlab run, resumed
    swanlab_loss = {}
    for run_dir in run_dirs:
        swanlab_loss.update(read_swanlab_scalars(run_dir)["loss"])
    assert swanlab_loss == pytest.approx(loss, rel=1e-6)

    traces = glob.glob(str(out / "profile" / "rank0.*.pt.trace.json"))
    assert len(traces) == 2  # step 2 by the first run, step 3 by the resumed one
    marks = []
    for trace in traces:
        with open(trace) as f:
            marks += profiled_steps(json.load(f)["traceEvents"])[0]
    assert sorted(marks) == [2, 3]


def test_grad_norm_on_the_console_and_clipped_only_when_it_was(capsys, tmp_path):
    tracker = Tracker(tmp_path / "m.jsonl")
    tracker.log(dict(train_record(1, 8.0), grad_norm=2.5, grad_clipped=True))
    tracker.log(dict(train_record(2, 7.0), grad_norm=0.25, grad_clipped=False))
    tracker.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "| lr 5.000e-04 | grad_norm 2.500 | clipped | tokens/s" in first
    assert "| lr 2.500e-04 | grad_norm 0.250 | tokens/s" in second


def test_tracker_flag_and_minimind_aliases(tmp_path):
    import argparse

    from model.errors import ConfigError
    from trainer.observe.tracking import resolve_trackers
    from trainer.plan.flags import add_train_args

    def trackers(*argv):
        return resolve_trackers(add_train_args(argparse.ArgumentParser()).parse_args(list(argv)), str(tmp_path))
    assert trackers() == ((), None)
    assert trackers("--use_wandb") == (("swanlab",), None)  # MiniMind's flag: swanlab
    assert trackers("--tracker", "tensorboard") == (("tensorboard",), str(tmp_path / "tensorboard"))
    assert trackers("--tracker", "swanlab,tensorboard", "--tensorboard_dir", "tb", "--use_wandb") == (
        ("swanlab", "tensorboard"), os.path.abspath("tb"))
    assert trackers("--tracker", "none") == ((), None)
    with pytest.raises(ConfigError, match="--tracker mlflow: mlflow is not one of swanlab, wandb, tensorboard, none"):
        trackers("--tracker", "mlflow")
    try:
        import wandb  # noqa: F401  (optional: only without it is the error line due)
    except ImportError:
        with pytest.raises(ConfigError, match="--tracker wandb needs the wandb package"):
            trackers("--tracker", "wandb")


def test_tracker_tensorboard_writes_under_the_save_dir(tmp_path):
    from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
    out = tmp_path / "out"
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--data_path", demo_slice(tmp_path, "pretrain", 32), "--max_seq_len", "32", "--batch_size", "4",
        "--accumulation_steps", "1", "--max_steps", "2", "--log_interval", "1", "--tracker", "tensorboard",
        "--save_dir", str(out), "--checkpoint_dir", str(tmp_path / "ckpt")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(out / "pretrain_64_metrics.jsonl"))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in ("loss", "grad_norm", "grad_clipped"):
        assert {e.step: e.value for e in events.Scalars(name)} == {r["step"]: float(np.float32(r[name]))
                                                                  for r in records}, name


def test_a_full_disk_under_the_metrics_file_or_tensorboard_is_one_line(small_disk, tmp_path, capfd):  # noqa: F811
    """The JSONL on a full disk: the first record's write is DiskFullError naming the file and the step; TensorBoard's
    writer on a full disk (its thread dies writing the file header): the same line naming its folder, and no thread
    traceback printed."""
    disk = small_disk(1)
    fill(disk)
    tracker = Tracker(os.path.join(disk, "m.jsonl"), last_checkpoint=lambda: "/ckpt/step_3")
    with pytest.raises(DiskFullError) as raised:
        tracker.log(train_record(4, 8.0))
    assert str(raised.value) == (f"disk full: cannot write the metrics of step 4 to {disk}/m.jsonl (No space left on "
                                 "device); the last complete checkpoint is /ckpt/step_3; free space, then resume "
                                 "with --from_resume 1")
    tracker.close()
    with pytest.raises(DiskFullError) as raised:
        Tracker(tmp_path / "m.jsonl", tensorboard_dir=os.path.join(disk, "tb"), last_checkpoint=lambda: None)
    assert str(raised.value) == (f"disk full: cannot write the metrics of step 1 to {disk}/tb (No space left on "
                                 "device); no complete checkpoint yet; free space, then run again")
    assert "Traceback" not in capfd.readouterr().err


def test_a_disk_filled_mid_run_stops_at_the_metrics_write_and_the_resume_continues_exactly(
        small_disk, tmp_path):  # noqa: F811
    """The disk of --metrics_file fills after step 1 (checkpoints elsewhere, every step): the run goes on while the
    JSONL's page has room, then stops at the first record that needs a new page with one line, exit 3, naming the
    last checkpoint (the step before). Space freed, --from_resume 1 drops the cut line and logs each step once, with
    the losses of an uninterrupted run (records are ~340 bytes: the 4 KiB page fills near step 12)."""
    from tests.helpers.fault_entry import STAGE
    from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
    disk, data, steps = small_disk(1), demo_slice(tmp_path, "pretrain", 128), 24
    common = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps",
              "1", "--log_interval", "1", "--max_steps", str(steps), "--save_dir", str(tmp_path / "out")]
    whole = forked("trainer/train_pretrain.py", [*common, "--checkpoint_dir", str(tmp_path / "ckpt0"), "--save_dir",
                                                 str(tmp_path / "out0")], timeout=300)  # its own run: its own files
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / "out0" / "pretrain_64_metrics.jsonl"))}

    ckpt, metrics = str(tmp_path / "ckpt"), os.path.join(disk, "m.jsonl")
    args = [*common, "--checkpoint_dir", ckpt, "--save_interval", "1", "--metrics_file", metrics]
    failed = forked("tests/helpers/fault_entry.py", args, env={STAGE: "train_pretrain",
                                                       "MINIMIND_TEST_FILL_DISK": f"1:{disk}/filler"}, timeout=300)
    assert failed.returncode == 3, failed.stdout[-2000:] + failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "Exception" not in failed.stderr, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    match = re.fullmatch(rf"error: disk full: cannot write the metrics of step (\d+) to {re.escape(metrics)} \(No "
                         rf"space left on device\); the last complete checkpoint is {re.escape(ckpt)}/pretrain_64/"
                         r"step_(\d+); free space, then resume with --from_resume 1", last)
    assert match and 1 < int(match[1]) == int(match[2]) + 1, last
    os.remove(f"{disk}/filler")
    resumed = forked("trainer/train_pretrain.py", [*args, "--from_resume", "1"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert {r["step"]: r["loss"] for r in records} == want  # exact resume: the same float32 sums, the same order
