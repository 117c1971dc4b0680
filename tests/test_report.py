"""scripts/report.py on a real run (tiny SFT with eval and samples): the page names the run's files and plots, its
numbers are the records', its samples are the greedy continuations of the saved weights (an argmax loop here) with
their repetition; two runs side by side; the run's own report at its end (--report 1)."""
import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import read_weights
from scripts.report import main as report
from tests.helpers.launch import TINY_MODEL, demo_slice, forked
from tests.helpers.serving import trained_ids
from trainer.judge.samples import MAX_NEW_TOKENS, PROMPTS
from trainer.judge.units import repetition

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    lines = open(demo_slice(tmp, "sft", 60, name="all.jsonl")).readlines()
    (tmp / "train.jsonl").write_text("".join(lines[:48]))
    (tmp / "eval.jsonl").write_text("".join(lines[48:]))
    proc = forked("trainer/train_sft.py", [*TINY_MODEL, "--from_weight", "none",
                                           "--data_path", str(tmp / "train.jsonl"),
                                           "--eval_data_path", str(tmp / "eval.jsonl"), "--max_seq_len", "128",
                                           "--batch_size", "2", "--max_steps", "4", "--eval_interval", "2",
                                           "--eval_batches", "2", "--log_interval", "1", "--learning_rate", "1e-3",
                                           "--save_dir", "out", "--checkpoint_dir", "checkpoints",
                                           "--cache_dir", "cache", "--report", "1"], cwd=str(tmp), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    page = tmp / "out" / "full_sft_64_report.md"
    assert f"report of this run: {page} (plots: {tmp / 'out' / 'full_sft_64_report.png'})" in proc.stdout
    (tmp / "at_the_end.md").write_text(page.read_text())  # before a test's scripts/report.py writes it again
    return tmp


def greedy_by_hand(model, ids, steps):
    """Argmax of the full forward, one token at a time (no KV cache), stopping at EOS."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if token == 2:  # <|im_end|>
            break
        out.append(token)
    return out


def test_samples_are_the_weights_greedy_continuations(sft_run):
    with open(sft_run / "out" / "full_sft_64_metrics_samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [2] * len(PROMPTS) + [4] * len(PROMPTS)  # each eval, every prompt
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    state_dict, config = read_weights(str(sft_run / "out" / "full_sft_64.pth"))  # the .pth and its sidecar
    model = MiniMindForCausalLM(MiniMindConfig(**config)).float()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    assert not unexpected and all(k.startswith("lm_head") for k in missing)  # tied lm_head: one copy
    model.eval()
    for row, prompt in zip(rows[len(PROMPTS):], PROMPTS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        want = greedy_by_hand(model, trained_ids(tokenizer, text), MAX_NEW_TOKENS)
        assert row["prompt"] == prompt and row["ids"] == want
        assert (row["repeated_4gram"], row["distinct_2"]) == repetition(want)


def test_the_report_names_the_files_numbers_samples_and_health(sft_run):
    out = report([str(sft_run / "out" / "full_sft_64_metrics.jsonl")])
    page = open(out).read()
    for name in ("full_sft_64_metrics.jsonl", "full_sft_64.pth", "full_sft_64.json", "full_sft_64_rank_0.log",
                 "full_sft_64_metrics_samples.jsonl", "full_sft_64_config.yaml", "full_sft_64_report.png"):
        assert name in page, name
    with open(out[:-3] + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in open(sft_run / "out" / "full_sft_64_metrics.jsonl")]
    last_eval = [r for r in records if "eval_loss" in r][-1]
    assert f"| last eval bits per byte | {last_eval['eval_bpb']:.4f} |" in page
    assert "Data: " in page and "## Samples (greedy, step 4)" in page and "- no health line" in page
    samples = [json.loads(line) for line in open(sft_run / "out" / "full_sft_64_metrics_samples.jsonl")][-1]
    assert f"| {samples['prompt']} | {samples['repeated_4gram']:.0%} | {samples['distinct_2']:.2f} |" in page


def test_two_runs_side_by_side(sft_run, tmp_path):
    dpo = os.path.join(ROOT, "docs", "reference", "shows", "dpo_default_lr_64_metrics.jsonl")
    out = report([str(sft_run / "out" / "full_sft_64_metrics.jsonl"), dpo, "--out", str(tmp_path / "both.md")])
    page = open(out).read()
    assert page.startswith("# Runs side by side: full_sft_64, dpo_default_lr_64")
    assert "| steps | 4 | 30 |" in page
    assert "- dpo_default_lr_64: step 20: DPO loss" in page and "- full_sft_64: no health line" in page
    assert os.path.getsize(tmp_path / "both.png") > 0


def test_a_reference_curve_beside_the_run(sft_run, tmp_path):
    reference = os.path.join(ROOT, "docs", "reference", "clean", "pretrain_64_demo_metrics.jsonl")
    out = report([str(sft_run / "out" / "full_sft_64_metrics.jsonl"), "--reference", reference,
                  "--out", str(tmp_path / "with_reference.md")])
    assert f"- reference curve: `{reference}`" in open(out).read()
    assert os.path.getsize(tmp_path / "with_reference.png") > 0


def test_the_run_writes_its_report_at_its_end(sft_run, tmp_path):
    """--report 1: the page the run wrote at its end is scripts/report.py's page of the same files, less the rank-0
    log's lines written after it (the callbacks' end: the log's close, `Done:`)."""
    at_the_end = (sft_run / "at_the_end.md").read_text()
    later = open(report([str(sft_run / "out" / "full_sft_64_metrics.jsonl"), "--out",
                         str(sft_run / "out" / "full_sft_64_report.md")])).read()
    assert [line for line in later.splitlines() if "Done:" not in line] == at_the_end.splitlines()
    assert "- plots: `" in at_the_end and "| last eval bits per byte |" in at_the_end
    with open(sft_run / "out" / "full_sft_64_report.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


CLEAN = os.path.join(ROOT, "docs", "reference", "clean")  # metrics files real runs wrote


def test_a_killed_run_s_cut_last_line_is_left_out(tmp_path, capsys):
    """A run stopped while writing a record leaves a last line cut short (no newline, not JSON): the page shows the
    records before it, says so, and counts the steps of the last whole record; a broken line inside is an error that
    names the file and the line."""
    lines = open(os.path.join(CLEAN, "sft_64_metrics.jsonl")).read().splitlines(keepends=True)
    cut = tmp_path / "out" / "killed_metrics.jsonl"
    cut.parent.mkdir()
    cut.write_text("".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])
    page = open(report([str(cut), "--out", str(tmp_path / "killed.md")])).read()
    whole = [json.loads(line) for line in lines[:-1]]
    assert f"| steps | {[r for r in whole if 'loss' in r][-1]['step']} |" in page
    assert f"note: the last line of `{cut}` was cut short" in page
    broken = tmp_path / "out" / "broken_metrics.jsonl"
    broken.write_text("".join(lines[:2]) + lines[2][:20] + "\n" + "".join(lines[3:]))
    with pytest.raises(SystemExit) as stop:
        report([str(broken), "--out", str(tmp_path / "broken.md")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: {broken}: line 3 is not JSON") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "broken.md")


def test_a_panel_with_the_reference_s_curve_alone_is_drawn_in_its_colour_with_a_legend():
    """A pretraining run beside a GRPO reference: the reward panel holds the reference's curve only; it is drawn in
    the reference's colour of the other panels (not the run's) and its legend names it."""
    from trainer.judge.plots import load_metrics, plot
    frames = [load_metrics(os.path.join(CLEAN, name)) for name in ("pretrain_64_demo_metrics.jsonl",
                                                                     "grpo_64_metrics.jsonl")]
    figure = plot(frames, ["pretrain_64_demo", "reference"])
    panels = {ax.get_title(): ax for ax in figure.axes if ax.get_visible()}
    colour = {line.get_label(): line.get_color() for line in panels["loss"].lines}
    assert colour["pretrain_64_demo"] != colour["reference"]
    reward = panels["reward (RL)"]
    assert [(line.get_label(), line.get_color()) for line in reward.lines] == [("reference", colour["reference"])]
    assert [text.get_text() for text in reward.get_legend().get_texts()] == ["reference"]


def provisional_steps(name):
    """(logged steps with an MFU, those whose MFU peak was provisional) of a clean reference run, counted here."""
    records = [json.loads(line) for line in open(os.path.join(CLEAN, name))]
    mfu = [r for r in records if "mfu" in r]
    return len(mfu), sum(1 for r in mfu if r.get("mfu_provisional") is True)


def test_mfu_against_differently_measured_peaks_is_said_on_the_page(tmp_path):
    """pretrain_256_demo's MFU is against a settled CPU peak at every step, pretrain_64_demo's and sft_64's against a
    provisional one at every step: side by side (or as a reference) the first two get a note, the last two none."""
    assert provisional_steps("pretrain_256_demo_metrics.jsonl") == (16, 0)
    assert provisional_steps("pretrain_64_demo_metrics.jsonl") == (31, 31)
    assert provisional_steps("sft_64_metrics.jsonl") == (15, 15)
    path = {name: os.path.join(CLEAN, f"{name}_metrics.jsonl") for name in ("pretrain_256_demo", "pretrain_64_demo",
                                                                            "sft_64")}
    both = open(report([path["pretrain_256_demo"], path["pretrain_64_demo"], "--out", str(tmp_path / "a.md")])).read()
    note = [line for line in both.splitlines() if "MFU" in line]
    assert len(note) == 1 and "peaks measured differently" in note[0], note
    assert "pretrain_256_demo: peak settled" in note[0] and "pretrain_64_demo: peak provisional" in note[0]
    alike = open(report([path["pretrain_64_demo"], path["sft_64"], "--out", str(tmp_path / "b.md")])).read()
    assert "MFU" not in alike
    referenced = open(report([path["sft_64"], "--reference", path["pretrain_256_demo"], "--out",
                              str(tmp_path / "c.md")])).read()
    assert "reference (pretrain_256_demo): peak settled" in referenced and "sft_64: peak provisional" in referenced
