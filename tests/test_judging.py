"""Judging a run while it trains (trainer/judge/units.py, health.py, samples.py): bits per byte of the eval text
against a float64 hand computation, the repetition of a token list by hand, and each health line on the record
stream made to show it and on no clean run's."""
import argparse
import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler
from transformers import AutoTokenizer

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, kill_at_step, resume_run
from trainer.core.build import build_trainer, setup
from trainer.core.evaluation import evaluate
from trainer.judge.health import scan
from trainer.judge.units import repetition
from trainer.observe.health_watch import HealthWatch
from trainer.plan.flags import add_train_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLEAN_DIR = os.path.join(ROOT, "docs", "reference", "clean")  # metrics of real clean runs
# whole documents shorter than a row (no cut inside a character), in three scripts: bytes per token differ
EVAL_TEXTS = ["The cat sat on the mat and looked at the garden.", "你好，世界！今天天气很好，我们去公园散步吧。",
              "Café déjà vu: naïve façade, résumé and piñata.", "1 + 1 = 2, and 2 * 3 = 6; print('hello')"]


def test_bits_per_byte_equals_a_float64_hand_count(tmp_path):
    """eval_bpb = the eval targets' summed CE in nats / (ln 2 x their UTF-8 bytes): the CE from a float64 copy of the
    model, the bytes from the tokenizer's decoding of each row's target tokens (not the per-token table)."""
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in EVAL_TEXTS))
    args = add_train_args(argparse.ArgumentParser()).parse_args([
        "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--device", "cpu", "--batch_size", "2", "--accumulation_steps", "1",
        "--max_seq_len", "64", "--packing", "0", "--eval_batches", "2", "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache"), "--log_dir", "none"])
    plan, dims = setup(args)
    trainer = build_trainer(plan, dims, steps_per_epoch=10)
    tokenizer = AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
    eval_ds = plan.stage.dataset(plan, tokenizer, str(path))
    assert len(eval_ds) == 4
    got = evaluate(trainer, eval_ds)
    reference = trainer.model_parts[0].double()
    nats, num_bytes, tokens = 0.0, 0, 0
    with torch.no_grad():
        for i in range(len(eval_ds)):
            ids, labels = (torch.as_tensor(x) for x in eval_ds[i][:2])
            targets = labels[1:]
            keep = targets != -100
            logits = reference(ids[None]).logits[0, :-1].double()
            nats += float(F.cross_entropy(logits[keep], targets[keep], reduction="sum"))
            text = tokenizer.decode(targets[keep].tolist())
            assert "\ufffd" not in text  # whole characters: the byte count is the text's
            num_bytes += len(text.encode("utf-8"))
            tokens += int(keep.sum())
    assert num_bytes > tokens  # more than a byte a token: a per-token unit would differ
    assert got["eval_loss"] == pytest.approx(nats / tokens, rel=1e-5)
    assert got["eval_bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-5)


def test_repetition_by_hand():
    # 4-grams of a b c d a b c d a b: abcd bcda cdab dabc abcd bcda cdab -> 7, of which 3 repeat an earlier one
    # bigrams ab bc cd da ab bc cd da ab -> 9, distinct 4
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert repetition(ids) == (pytest.approx(3 / 7), pytest.approx(4 / 9))
    assert repetition([5, 6, 7, 8, 9]) == (0.0, 1.0)
    assert repetition([5]) == (0.0, 1.0)  # nothing to repeat


LN_V = math.log(6400)


def train_records(n, **fields):
    """n logged steps 1..n of a clean-looking run; `fields`: name -> a function of the index, overriding."""
    base = dict(loss=lambda i: 6.0 - 0.01 * i, grad_norm=lambda i: 1.0 + 0.01 * (i % 3), skipped_steps=lambda i: 0)
    base.update(fields)
    return [dict(step=i + 1, **{k: f(i) for k, f in base.items()}) for i in range(n)]


def overfit_stream():
    train = train_records(40, loss=lambda i: 4.0 - 0.05 * i)
    evals = {10: 3.0, 20: 3.1, 30: 3.2, 40: 3.3}
    return [r for r in train for r in ([r] + ([dict(step=r["step"], eval_loss=evals[r["step"]])]
                                               if r["step"] in evals else []))]


MADE_TO_SHOW = {  # kind -> (a record stream made to show it, the step it is said at)
    "stuck": (train_records(60, loss=lambda i: LN_V - 0.05), 50),
    "spike": (train_records(12, loss=lambda i: 3.0 if i < 11 else 9.5), 12),
    "grad_norm": (train_records(15, grad_norm=lambda i: 1.0 if i < 10 else 2.0 ** (i - 9)), 14),  # 1 2 4 8 16
    "skipped": (train_records(6, skipped_steps=lambda i: max(0, i - 1)), 5),
    "dpo_stuck": (train_records(25, loss=lambda i: math.log(2), **{"rewards/margins": lambda i: 0.0}), 20),
    "rl_flat": (train_records(10, reward=lambda i: 0.5 + 0.001 * (i % 2),
                              **{"completions/mean_length": lambda i: 10.0 + 2 * i}), 10),
    "overfit": (overfit_stream(), 40),
    "idle_expert": (train_records(6, **{"expert_tokens_min/layer1": lambda i: 0,
                                        "expert_tokens_max/layer1": lambda i: 100}), 5),
}


@pytest.mark.parametrize("kind", sorted(MADE_TO_SHOW))
def test_each_health_line_on_the_stream_made_to_show_it(kind):
    stream, step = MADE_TO_SHOW[kind]
    found = scan(stream, 6400)
    assert [(k, s) for k, s, _ in found] == [(kind, step)], found  # said once, at that step, and nothing else
    assert "Try" in found[0][2] or "Keep" in found[0][2]  # what to try


def test_health_says_each_line_once_and_remembers_through_a_resume():
    watch = HealthWatch(6400)
    lines = []
    watch.say = lambda found: lines.extend(found)
    stream, _ = MADE_TO_SHOW["skipped"]
    for record in stream + train_records(3, skipped_steps=lambda i: 9):
        watch.on_step_end(None, record)
    assert [k for k, _, _ in lines] == ["skipped"]
    resumed = HealthWatch(6400)
    resumed.load_state_dict(watch.state_dict())
    resumed.say = lambda found: lines.extend(found)
    resumed.on_step_end(None, dict(step=20, loss=3.0, grad_norm=1.0, skipped_steps=12))
    assert len(lines) == 1


def test_a_spike_right_after_a_resume_is_said_as_without_one():
    """The watch's saved state carries the records the checks read: the spike two records after a resume is said at
    the step and in the words scan() finds on the whole stream."""
    stream, step = MADE_TO_SHOW["spike"]
    watch = HealthWatch(6400)
    for record in stream[:-2]:
        watch.on_step_end(None, record)
    resumed, lines = HealthWatch(6400), []
    resumed.load_state_dict(watch.state_dict())
    resumed.say = lambda found: lines.extend(found)
    for record in stream[-2:]:
        resumed.on_step_end(None, record)
    assert lines == scan(stream, 6400) and lines[0][:2] == ("spike", step)


@pytest.mark.parametrize("report, elapsed, writes", [("auto", 59.9, False), ("auto", 60.0, True), ("1", 1.0, True),
                                                     ("0", 3600.0, False)])
def test_the_report_at_the_end_under_report(report, elapsed, writes):
    """--report 1 writes it, 0 does not, auto from a run whose last logged record is a minute in (REPORT_AFTER_S)."""
    watch = HealthWatch(6400, "run_metrics.jsonl", report)
    for record in train_records(3, elapsed_s=lambda i: elapsed * (i + 1) / 3):
        watch.on_step_end(None, record)
    assert watch.writes_report() is writes


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(CLEAN_DIR) if n.endswith("_metrics.jsonl")))
def test_no_health_line_on_a_clean_run(name):
    """The recorded metrics of real clean runs (docs/reference/: the commands in its README) say nothing."""
    records = read_records(os.path.join(CLEAN_DIR, name))
    assert len([r for r in records if "loss" in r]) >= 5
    assert scan(records, 6400) == []


def test_the_dpo_line_on_the_real_run_at_minimind_s_dpo_learning_rate():
    """A real DPO run at MiniMind's default learning rate (4e-8) stays at ln 2: the line is said at step 20."""
    found = scan(read_records(os.path.join(os.path.dirname(CLEAN_DIR), "shows", "dpo_default_lr_64_metrics.jsonl")),
                 6400)
    assert [(k, s) for k, s, _ in found] == [("dpo_stuck", 20)]


@pytest.mark.slow
def test_a_real_run_says_the_stuck_line_once(tmp_path):
    """Through the loop's callback: a pretraining run whose learning rate cannot move it says the stuck line at step
    50, once, and names its report at the end."""
    data = demo_slice(tmp_path, "pretrain", 200)
    proc = forked("trainer/train_pretrain.py", [*TINY_MODEL, "--data_path", data, "--learning_rate", "1e-12",
                                                "--batch_size", "2", "--accumulation_steps", "1", "--max_seq_len", "32",
                                                "--max_steps", "54", "--log_interval", "2", "--save_dir",
                                                str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
                                                "--cache_dir", str(tmp_path / "cache")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    health = [line for line in proc.stdout.splitlines() if "health:" in line]
    assert len(health) == 1 and "health: step 50: loss" in health[0] and "ln(vocab)" in health[0], health
    assert "report of this run: python scripts/report.py" in proc.stdout


@pytest.mark.slow
def test_a_real_run_says_a_spike_two_steps_after_its_resume(tmp_path):
    """A pretraining run on one repeated line (its loss falls to about 2 within a few steps) whose step 12 draws two
    rows of random CJK characters (placed where the sampler's order puts step 12), killed after step 10 and resumed:
    the resumed run says the spike at step 12, as scan() finds it in the whole metrics file."""
    rows, spike_step, batch, seed = 32, 12, 2, 42
    order = list(DistributedSampler(range(rows), num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True))
    bad, rng = set(order[(spike_step - 1) * batch:spike_step * batch]), random.Random(0)
    texts = ["".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(12)) if i in bad else
             "the cat sat on the mat. " * 3 for i in range(rows)]
    data = tmp_path / "spike.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    run = [*TINY_MODEL, "--data_path", str(data), "--from_weight", "none", "--packing", "0", "--max_seq_len", "32",
           "--batch_size", str(batch), "--accumulation_steps", "1", "--learning_rate", "3e-2", "--seed", str(seed),
           "--max_steps", str(spike_step + 1), "--log_interval", "1", "--save_interval", str(spike_step - 2),
           "--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
           "--cache_dir", str(tmp_path / "cache"), "--metrics_file", str(tmp_path / "metrics.jsonl")]
    kill_at_step("train_pretrain", run, spike_step - 2)
    resumed = resume_run("trainer/train_pretrain.py", run, spike_step - 2)
    found = scan(read_records(tmp_path / "metrics.jsonl"), 6400)
    assert [(kind, step) for kind, step, _ in found] == [("spike", spike_step)], found
    said = [line for line in resumed.stdout.splitlines() if "health:" in line]
    assert len(said) == 1 and said[0].endswith(f"health: step {spike_step}: {found[0][2]}"), said
