"""trainer/runtime/callbacks.py in real runs: the best checkpoint is the argmin of the eval losses the run recorded,
early stopping stops at the eval the rule (written out here) picks, both survive a resume, and a user's --callbacks
object sees the records the metrics file holds, stops the run and keeps its state across a resume."""
import json
import os

import pytest
import torch

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.ckpt.resume import read_checkpoint_model

SCRIPT = "trainer/train_pretrain.py"
STEPS = 12
# lr 0.02 constant: the tiny model's eval loss falls for a few steps, then wanders (a best mid-run, then no progress)
COMMON = ["--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps", "1", "--learning_rate", "0.02",
          "--lr_schedule", "constant", "--eval_interval", "1", "--eval_batches", "2", "--log_interval", "1",
          "--save_interval", "100", "--max_steps", str(STEPS)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    lines = open(demo_slice(folder, "pretrain", 200, name="all.jsonl")).readlines()
    (folder / "train.jsonl").write_text("".join(lines[:64]))
    (folder / "eval.jsonl").write_text("".join(lines[150:]))
    return str(folder / "train.jsonl"), str(folder / "eval.jsonl")


def run(workdir, data, *extra, script=SCRIPT):
    args = [*TINY_MODEL, *COMMON, "--data_path", data[0], "--eval_data_path", data[1],
            "--save_dir", os.path.join(workdir, "out"), "--checkpoint_dir", os.path.join(workdir, "ckpt"),
            "--metrics_file", os.path.join(workdir, "m.jsonl"), *extra]
    proc = forked(script, args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def evals(workdir):
    with open(os.path.join(workdir, "m.jsonl")) as f:
        return [(r["step"], r["eval_loss"]) for r in map(json.loads, f) if "eval_loss" in r]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """STEPS steps with an eval each, --save_best 1 and one checkpoint kept besides the best."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    run(workdir, data, "--save_best", "1", "--keep_checkpoints", "1")
    return workdir


def test_best_checkpoint_is_the_argmin_of_the_recorded_eval_losses(reference, data, tmp_path):
    recorded = evals(reference)
    assert [s for s, _ in recorded] == list(range(1, STEPS + 1))
    best_step, best_loss = min(recorded, key=lambda e: (e[1], e[0]))
    assert 1 < best_step < STEPS  # the data make this a real test: the best is neither the first nor the last
    run_dir = os.path.join(reference, "ckpt", "pretrain_64")
    index = json.load(open(os.path.join(run_dir, "best.json")))
    assert (index["step"], index["eval_loss"]) == (best_step, best_loss)
    # --keep_checkpoints 1 pruned every other step, never the best
    assert set(os.listdir(run_dir)) == {"best.json", f"step_{best_step}", f"step_{STEPS}"}
    assert os.path.isfile(os.path.join(run_dir, f"step_{best_step}", "complete.json"))
    weights = torch.load(os.path.join(reference, "out", "pretrain_64_best.pth"))
    model_state, _, _ = read_checkpoint_model(os.path.join(run_dir, f"step_{best_step}"))
    assert weights.keys() <= model_state.keys() and all(torch.equal(weights[k], model_state[k]) for k in weights)
    assert index["weights"] == os.path.join(reference, "out", "pretrain_64_best.pth")
    # stopped after the best (--max_tokens) and resumed: the best so far came back with the checkpoint (a fresh one
    # would take the first eval after the resume, worse than the best)
    split = str(tmp_path / "split")
    tokens = read_metrics(os.path.join(reference, "m.jsonl"))[best_step]["tokens"]  # one step after the best
    run(split, data, "--save_best", "1", "--keep_checkpoints", "1", "--max_tokens", str(tokens))
    run(split, data, "--save_best", "1", "--keep_checkpoints", "1", "--from_resume", "1")
    assert evals(split) == recorded
    assert json.load(open(os.path.join(split, "ckpt", "pretrain_64", "best.json")))["step"] == best_step
    assert set(os.listdir(os.path.join(split, "ckpt", "pretrain_64"))) == set(os.listdir(run_dir))


def expected_stop(recorded, patience, min_delta):
    """The step early stopping must stop at: the patience-th eval in a row not below best - min_delta."""
    best, without = None, 0
    for step, loss in recorded:
        if best is None or loss < best - min_delta:
            best, without = loss, 0
        else:
            without += 1
            if without == patience:
                return step
    return None


def test_early_stopping_stops_at_the_right_eval_and_resumes_exactly(data, reference, tmp_path):
    recorded = evals(reference)
    stop = expected_stop(recorded, patience=3, min_delta=0.0)
    assert stop is not None and stop < STEPS
    early = str(tmp_path / "early")
    proc = run(early, data, "--early_stop_patience", "3")
    assert f"stopped: early stopping at step {stop}: 3 evals without" in proc.stdout
    assert evals(early) == recorded[:stop]  # the same run up to there, then stopped
    assert [r["step"] for r in read_metrics(os.path.join(early, "m.jsonl"))] == list(range(1, stop + 1))
    assert os.path.isfile(os.path.join(early, "ckpt", "pretrain_64", f"step_{stop}", "complete.json"))
    # stopped one eval short (--max_tokens), resumed: the count of evals without progress came back with it
    split = str(tmp_path / "split")
    tokens = read_metrics(os.path.join(reference, "m.jsonl"))[stop - 2]["tokens"]
    run(split, data, "--early_stop_patience", "3", "--max_tokens", str(tokens))
    assert evals(split) == recorded[:stop - 1]
    proc = run(split, data, "--early_stop_patience", "3", "--from_resume", "1")
    assert f"stopped: early stopping at step {stop}" in proc.stdout and evals(split) == recorded[:stop]
    proc = run(split, data, "--early_stop_patience", "3", "--from_resume", "1")  # resuming a stopped run
    assert "nothing to train" in proc.stdout and evals(split) == recorded[:stop]


RECORDER = '''
import json, os
import torch.distributed as dist


class Recorder:
    """Writes what it sees; stops the run after its 3rd and 5th step (its step count is its checkpointed state)."""

    def __init__(self):
        self.steps, self.seen, self.stop_reason = 0, [], None

    def on_step_end(self, trainer, record):
        self.steps += 1
        self.stop_reason = f"recorder: {self.steps} steps" if self.steps in (3, 5) else None
        if record is not None:
            self.seen.append(["step", record["step"], record["loss"], record["grad_norm"]])

    def on_eval(self, trainer, record):
        self.seen.append(["eval", record["step"], record["eval_loss"]])

    def on_save(self, trainer, step):
        self.seen.append(["save", step])

    def on_train_end(self, trainer):
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(os.environ["RECORDER_OUT"], "a") as f:
                f.write(json.dumps(self.seen) + "\\n")

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]
'''


def test_a_users_callback_sees_the_records_stops_and_resumes(data, tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    out = tmp_path / "seen.jsonl"
    os.environ["RECORDER_OUT"] = str(out)  # the forked run inherits it
    try:
        workdir, spec = str(tmp_path / "run"), f"{tmp_path / 'recorder.py'}:Recorder"
        proc = run(workdir, data, "--callbacks", spec, "--eval_interval", "2")
        assert "stopped: recorder: 3 steps" in proc.stdout
        proc = run(workdir, data, "--callbacks", spec, "--eval_interval", "2", "--from_resume", "1")
        assert "stopped: recorder: 5 steps" in proc.stdout  # its count came back: 3 + 2, not a fresh 3
    finally:
        del os.environ["RECORDER_OUT"]
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    records = read_metrics(os.path.join(workdir, "m.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    seen_steps = [e for e in first + second if e[0] == "step"]
    assert seen_steps == [["step", r["step"], r["loss"], r["grad_norm"]] for r in records]
    assert [e for e in first + second if e[0] == "eval"] == [["eval", s, v] for s, v in evals(workdir)]
    assert [e[1] for e in first if e[0] == "save"] == [3] and [e[1] for e in second if e[0] == "save"] == [5]
    assert [e[1] for e in first if e[0] == "eval"] == [2, 3]  # every 2 steps, and at the run's end


@pytest.mark.parametrize("spec,needle", [("nofile.py:X", "does not exist"), ("recorder.py", "write FILE.py:NAME"),
                                         ("recorder.py:Missing", "defines no Missing")])
def test_bad_callbacks_are_one_line(data, tmp_path, spec, needle):
    (tmp_path / "recorder.py").write_text(RECORDER)
    args = [*TINY_MODEL, *COMMON, "--data_path", data[0], "--save_dir", str(tmp_path / "out"),
            "--checkpoint_dir", str(tmp_path / "ckpt"), "--callbacks", str(tmp_path / spec)]
    proc = forked(SCRIPT, args, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    proc = forked(SCRIPT, [*args[:-1], str(tmp_path / "recorder.py:Recorder"), "--save_best", "1"], timeout=120)
    assert proc.returncode == 2 and "--save_best 1 follows the eval loss" in proc.stderr
