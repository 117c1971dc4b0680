"""trainer/observe/console.py and the lines around it: one line per fact, each agreeing with the bar and the metrics
(the run's length, what the data rows are, where the weights come from, the RL records); output that survives a
reader that left (trainer/base/streams.py); the demo corpus build says what it does."""
import json
import os
import re

from transformers import AutoTokenizer

from dataset.demo_data import ensure_demo_data
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics
from trainer.base.streams import SurvivingStream
from trainer.observe.tracking import console_line

SCRIPT = "trainer/train_pretrain.py"


def run_args(tmp_path, data, max_steps):
    out = os.path.join(str(tmp_path), "run")
    return [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps",
            "2", "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt"), "--metrics_file",
            os.path.join(out, "metrics.jsonl"), "--log_interval", "1", "--max_steps", str(max_steps)]


def packed_rows(data, seq_len):
    """Rows of packed pretraining data, counted here: every document is bos + its tokens + eos, all of them
    concatenated and cut into full rows of seq_len (dataset/lm_dataset.py PretrainDataset's rule)."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    with open(data) as f:
        texts = [json.loads(line)["text"] for line in f]
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2 for text in texts)
    return tokens // seq_len, len(texts)


def test_the_start_lines_agree_with_the_bar_and_the_metrics(tmp_path):
    """--max_steps 3 of a longer epoch, 2 micro-batches a step: the run line, the bar and the records all say 3 steps
    (the bar said '1 epoch x 96 steps' and counted to 40); the data line says what its rows are; a resumed run does
    not say its weights were initialised from --seed."""
    data = demo_slice(tmp_path, "pretrain", 200)
    rows, documents = packed_rows(data, 32)
    per_epoch = rows // 4  # global batch: 2 samples x 2 micro-batches
    run = forked(SCRIPT, run_args(tmp_path, data, 3), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert f"({rows} rows of 32 tokens packed from {documents} documents)" in out, out[-3000:]
    assert f"\n3 optimizer steps (--max_steps 3; one epoch is {per_epoch}), global batch 4 x 32 tokens" in out
    final_bar = [piece for piece in re.split(r"[\r\n]", out) if piece.startswith("3 steps x 2 mb: 100%")]
    assert final_bar and "6/6" in final_bar[-1], out[-3000:]
    assert [r["step"] for r in read_metrics(os.path.join(str(tmp_path), "run", "metrics.jsonl"))] == [1, 2, 3]
    assert out.count("Model params:") == 1 and "initialised from --seed" in out
    resumed = forked(SCRIPT, run_args(tmp_path, data, 4) + ["--from_resume", "1"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "initialised from --seed" not in out and "weights from the checkpoint resumed below" in out, out[-3000:]
    assert "Resumed from epoch 0, step 3" in out and "\n4 optimizer steps (--max_steps 4;" in out


def test_rl_records_show_their_reward_and_a_reused_rollout():
    """PPO's console showed no reward (its record calls it ppo/mean_scores, TRL's name), and a step that trained on
    the last rollout again showed an unexplained 'rollout 0%'. A zero time share alone (GKD's offline step, which
    trains on the data's answers) is not a reuse."""
    ppo = {"step": 4, "loss": 0.5, "ppo/mean_scores": 0.25, "tokens/responses_len_mean": 12.0,
           "rollout/time_share": 0.0, "rollout/reused": True}
    assert console_line(ppo) == "step 4 | loss 0.500000 | reward 0.2500 | len 12.0 | rollout reused"
    gkd = {"step": 1, "loss": 0.5, "rollout/time_share": 0.0}
    assert console_line(gkd) == "step 1 | loss 0.500000 | rollout 0% of the time"
    grpo = {"step": 5, "loss": 0.5, "reward": 0.75, "rollout/time_share": 0.625}
    assert console_line(grpo) == "step 5 | loss 0.500000 | reward 0.7500 | rollout 62% of the time"


def test_a_closed_pipe_ends_the_output_not_the_writer():
    """Writes and flushes to a pipe whose reader has gone (tee killed by the same Ctrl-C) raise nothing: the
    descriptor now points at /dev/null, so later writes (the bar, the save's lines) go nowhere, quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = SurvivingStream(os.fdopen(write_end, "w", buffering=1))
    stream.write("preempted: the line after tee died\n")  # line-buffered: the write itself reaches the pipe
    stream.write("x" * 100000)
    stream.flush()
    assert os.path.samefile(f"/proc/self/fd/{stream.fileno()}", os.devnull)
    stream.close()


def test_the_demo_corpus_build_says_what_it_does(tmp_path):
    """The first run built the demo corpus for ~20 s and printed nothing: now one line first, and none once it is
    built."""
    lines = []
    path = ensure_demo_data("agent", str(tmp_path), announce=lines.append)
    assert lines == [f"building the demo corpus {path} (first use only; tool questions, a few s)"]
    assert ensure_demo_data("agent", str(tmp_path), announce=lines.append) == path and len(lines) == 1
