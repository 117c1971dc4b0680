"""scripts/eval_bench.py: lm-eval on our model object, offline, on a multiple-choice task written here (YAML + JSONL
in tmp_path); its accuracies equal a hand computation from our model's log-likelihoods, and the HF export scores the
same."""
import json
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer

from model.hf_convert import save_hf_folder
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import read_weights, save_weights_file
from scripts.eval_bench import INSTALL, MINIMIND_TASKS, main
from tests.helpers.eval_tasks import DOCS, write_task
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics
from trainer.ckpt.resume import read_checkpoint_model

lm_eval = pytest.importorskip("lm_eval")  # requirements.txt installs it; a bare environment skips, naming it

SHAPE = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2"]


def tiny_model():
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return MiniMindForCausalLM(config).eval()


def choice_loglikelihoods(model, tokenizer, doc):
    """sum log p(continuation tokens | context) per choice, continuation = " " + choice: the tokens of context +
    continuation after those of the context alone (lm-eval's split), from one full forward in float64."""
    context = f"Question: {doc['question']}\nAnswer:"
    context_ids = tokenizer(context).input_ids
    scores = []
    for choice in doc["choices"]:
        whole = tokenizer(context + " " + choice).input_ids
        assert whole[:len(context_ids)] == context_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
        scores.append(sum(logp[t - 1, whole[t]].item() for t in range(len(context_ids), len(whole))))
    return scores


def hand_accuracies(model, tokenizer, docs):
    """acc: argmax log-likelihood is the label; acc_norm: argmax of log-likelihood / len(choice) in characters."""
    acc = acc_norm = 0
    for doc in docs:
        scores = choice_loglikelihoods(model, tokenizer, doc)
        ranked = sorted(scores)
        assert ranked[-1] - ranked[-2] > 1e-3  # no near tie: fp32 batching in lm-eval cannot flip the choice
        norm = [s / len(c) for s, c in zip(scores, doc["choices"])]
        acc += scores.index(max(scores)) == doc["label"]
        acc_norm += norm.index(max(norm)) == doc["label"]
    return acc / len(docs), acc_norm / len(docs)


def test_scores_equal_a_hand_computation_from_our_log_likelihoods(tmp_path, offline, capsys):
    model = tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    save_weights_file(model.state_dict(), model.config, str(tmp_path / "pretrain_64.pth"))
    tasks = write_task(tmp_path / "tasks")
    argv = ["--weight", str(tmp_path / "pretrain_64.pth"), "--tasks", "tiny_mc", "--include_path", str(tasks),
            "--out_dir", str(tmp_path / "report"), "--device", "cpu", "--batch_size", "4", *SHAPE]
    (row,) = main(argv)
    acc, acc_norm = hand_accuracies(model, tokenizer, DOCS)
    assert (row["acc"], row["acc_norm"], row["samples"]) == (acc, acc_norm, len(DOCS))
    assert 0 < acc < 1  # the check can tell a wrong choice from a right one
    written = json.loads((tmp_path / "report" / "pretrain_64.json").read_text())
    assert written["scores"][0]["acc"] == acc and written["tasks"] == ["tiny_mc"]
    table = (tmp_path / "report" / "pretrain_64.md").read_text()
    assert f"| tiny_mc | {100 * acc:.2f} | {100 * acc_norm:.2f} | {len(DOCS)} |" in table
    assert table in capsys.readouterr().out
    assert (tmp_path / "report" / "pretrain_64.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --limit 3: the first three documents; the HF export (transformers' Qwen3) scores what our model scores
    save_hf_folder(model.state_dict(), model.config, str(tmp_path / "hf"), torch.float32)
    tokenizer.save_pretrained(str(tmp_path / "hf"))
    (row,) = main(["--load_from", str(tmp_path / "hf"), "--tasks", "tiny_mc", "--include_path", str(tasks),
                   "--out_dir", str(tmp_path / "report"), "--device", "cpu", "--limit", "3", "--name", "hf"])
    assert (row["acc"], row["acc_norm"], row["samples"]) == (*hand_accuracies(model, tokenizer, DOCS[:3]), 3)
    assert (tmp_path / "report" / "hf.png").is_file()


@pytest.fixture(scope="module")
def whole_index(tmp_path_factory):
    """lm-eval's whole task index with this file's task folder, (the folder, the index): built once for the two tests
    that need it (it indexes lm-eval's thousands of task files: ~30 s of CPU each time)."""
    from lm_eval.tasks import TaskManager  # the optional dependency, as the script imports it
    tasks = str(write_task(tmp_path_factory.mktemp("whole_index") / "tasks"))
    return tasks, TaskManager(include_path=tasks)


@pytest.mark.parametrize("argv, message, code", [
    (["--tasks", "tiny_mc", "--limit", "2.5"], "--limit must be a whole number of documents or a fraction", 2),
    (["--tasks", " , "], "--tasks is empty", 2),
])
def test_bad_input_is_one_error_line(tmp_path, offline, capsys, argv, message, code):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--include_path", str(write_task(tmp_path / "tasks")), "--weight", str(tmp_path / "x.pth")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == code and err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.slow  # the whole index (whole_index)
def test_an_unknown_task_is_one_error_line(whole_index, tmp_path, offline, monkeypatch, capsys):
    """A name in neither the include folder nor lm-eval: the script indexes lm-eval's own tasks (TaskManager with
    the folder, here the index built once with the same arguments), then one error line, exit 2."""
    tasks, index = whole_index
    real = lm_eval.tasks.TaskManager

    def manager(include_path=None, include_defaults=True, **kwargs):
        same = (include_path, include_defaults, kwargs) == (tasks, True, {})
        return index if same else real(include_path=include_path, include_defaults=include_defaults, **kwargs)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)
    with pytest.raises(SystemExit) as exit_info:
        main(["--tasks", "no_such_task", "--include_path", tasks, "--weight", str(tmp_path / "x.pth")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error: ") and "\n" not in err
    assert "--tasks: no_such_task is not an lm-eval task or group" in err


@pytest.mark.slow  # the whole index (whole_index)
def test_minimind_tasks_are_lm_eval_names(whole_index):
    """The seven names exist in the installed lm-eval (tasks or groups), so --tasks minimind runs as is."""
    _, manager = whole_index
    known = set(manager.all_tasks) | set(manager.all_groups)
    assert set(MINIMIND_TASKS) <= known, set(MINIMIND_TASKS) - known


def test_missing_lm_eval_is_one_line_naming_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets where it is not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["--tasks", "piqa"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 3 and err.startswith("error: lm-eval is not installed") and "\n" not in err
    assert err.endswith(INSTALL) and INSTALL.startswith("pip install 'lm-eval")


def bench_run_args(tmp_path, tasks, *extra):
    """A tiny pretraining run (TINY_MODEL, 2 steps, a checkpoint each step) scoring tiny_mc after every step."""
    data = demo_slice(tmp_path, "pretrain", 64)
    return [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps", "1",
            "--learning_rate", "0.02", "--lr_schedule", "constant", "--log_interval", "1", "--save_interval", "1",
            "--max_steps", "2", "--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--cache_dir", str(tmp_path / "cache"), "--metrics_file", str(tmp_path / "m.jsonl"),
            "--eval_bench", "tiny_mc", "--eval_bench_include", str(tasks), "--eval_bench_interval", "1", *extra]


def model_of(state, config):
    model = MiniMindForCausalLM(MiniMindConfig(**config))
    model.load_state_dict(state)
    return model.eval()


def test_training_logs_the_scores_of_each_steps_weights(tmp_path, offline):
    """--eval_bench tiny_mc --eval_bench_interval 1: the records of steps 1 and 2 carry bench/tiny_mc/acc and acc_norm,
    equal to the hand computation from that step's checkpointed weights (step 2's also the final out/*.pth)."""
    tasks = write_task(tmp_path / "tasks")
    proc = forked("trainer/train_pretrain.py", bench_run_args(tmp_path, tasks), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp_path / "m.jsonl") as f:
        bench = {r["step"]: r for r in map(json.loads, f) if "bench/tiny_mc/acc" in r}
    assert sorted(bench) == [1, 2]
    assert bench[1]["bench/tiny_mc/acc"] != bench[2]["bench/tiny_mc/acc"]  # the check tells the steps' weights apart
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    (run_dir,) = {path.parent for path in (tmp_path / "ckpt").glob("*/step_1")}
    for step in (1, 2):
        state, config, _ = read_checkpoint_model(str(run_dir / f"step_{step}"))
        acc, acc_norm = hand_accuracies(model_of(state, config), tokenizer, DOCS)
        assert (bench[step]["bench/tiny_mc/acc"], bench[step]["bench/tiny_mc/acc_norm"]) == (acc, acc_norm)
    (weights,) = (tmp_path / "out").glob("*.pth")
    final, config = read_weights(str(weights))
    assert hand_accuracies(model_of(final, config), tokenizer, DOCS) == (acc, acc_norm)
    # scoring leaves training as it was (eval mode and the RNGs put back): the losses of the run without it
    (tmp_path / "plain").mkdir()
    plain = bench_run_args(tmp_path / "plain", tasks)[:-6]  # the last six: the --eval_bench flags
    proc = forked("trainer/train_pretrain.py", plain, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "plain" / "m.jsonl")] == [
        r["loss"] for r in read_metrics(tmp_path / "m.jsonl")]


@pytest.mark.parametrize("extra, message, code, nproc", [
    (["--eval_bench_limit", "0"], "--eval_bench_limit", 2, 1),
    (["--eval_bench", " , "], "--eval_bench is empty", 2, 1),
    (["--eval_bench_include", "/no/such/folder"], "--eval_bench_include /no/such/folder is not a folder", 2, 1),
    ([], "--eval_bench scores in one process", 2, 2),
])
def test_bad_training_flags_are_one_error_line(tmp_path, offline, extra, message, code, nproc):
    argv = bench_run_args(tmp_path, write_task(tmp_path / "tasks"), *extra)
    proc = forked("trainer/train_pretrain.py", argv, nproc=nproc, timeout=120)
    err = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == code and len(err) == 1 and message in err[0], proc.stderr[-2000:]
    assert not (tmp_path / "m.jsonl").exists()  # refused before training


def test_training_without_lm_eval_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # the forked run meets `import lm_eval` failing
    proc = forked("trainer/train_pretrain.py", bench_run_args(tmp_path, write_task(tmp_path / "tasks")), timeout=120)
    err = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 3 and len(err) == 1 and err[0].endswith(INSTALL), proc.stderr[-2000:]
