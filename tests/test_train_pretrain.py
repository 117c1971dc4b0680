"""End-to-end runs of trainer/train_pretrain.py (forked from the test: tests/helpers/launch.py forked): quick start,
learning,
exact resume, bad input."""
import math
import os

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics, run_in_process, write_rows
from trainer import train_pretrain
from trainer.observe import metrics
from trainer.plan.checks import small_batch

SCRIPT = "trainer/train_pretrain.py"


def run_pretrain(tmp_path, *extra, timeout=600):
    out = os.path.join(str(tmp_path), "out")
    args = [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", os.path.join(str(tmp_path), "ckpt"),
            "--metrics_file", os.path.join(out, "metrics.jsonl"), "--log_interval", "1", *extra]
    proc = forked(SCRIPT, args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(os.path.join(out, "metrics.jsonl")), out


def test_quick_start_tiny_learns_on_demo_corpus(tmp_path):
    # the README command on the default (embedded) corpus, in a tiny config
    records, out = run_pretrain(tmp_path, "--epochs", "1", "--max_steps", "30", "--max_seq_len", "64",
                                "--batch_size", "8", "--accumulation_steps", "1", "--learning_rate", "3e-3")
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert first == pytest.approx(torch.log(torch.tensor(6400.0)).item(), rel=0.05)  # random init: ~ln(vocab)
    assert last < first - 1.0, (first, last)  # it learns: perplexity down by more than a factor e
    for key in ("epoch", "aux_loss", "lr", "tokens_per_sec", "mfu", "peak_mem_gb", "elapsed_s"):
        assert key in records[-1]
    weights = torch.load(os.path.join(out, "pretrain_64.pth"))
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(weights)  # a plain full state dict, loadable by one process


def test_resume_is_exact_mid_epoch_with_accumulation(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 48)  # 48 docs / (4 x 2) = 6 steps per epoch
    common = ["--data_path", data, "--packing", "0", "--epochs", "2", "--max_seq_len", "64", "--batch_size", "4",
              "--accumulation_steps", "2", "--learning_rate", "2e-3"]
    full, _ = run_pretrain(tmp_path / "full", *common, "--max_steps", "9")
    # stops mid-epoch 1 at step 4; by --max_tokens, which leaves the lr schedule's length (--max_steps) alone
    first, _ = run_pretrain(tmp_path / "split", *common, "--max_steps", "9", "--max_tokens", str(full[3]["tokens"]))
    resumed, _ = run_pretrain(tmp_path / "split", *common, "--max_steps", "9", "--from_resume", "1")
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in full] == list(range(1, 10))
    assert [r["step"] for r in resumed] == list(range(1, 10))  # the resumed run appends to the metrics file
    for a, b in zip(full, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"] and a["epoch"] == b["epoch"]
    assert full[-1]["epoch"] == 1  # crossed the epoch boundary


def test_typed_paths_follow_the_cwd(tmp_path):
    """Run from outside the repo with relative paths: outputs land beside the user, under the default names."""
    demo_slice(tmp_path, "pretrain", 32, name="d.jsonl")
    proc = forked(SCRIPT, [*TINY_MODEL, "--data_path", "d.jsonl", "--save_dir", "o", "--checkpoint_dir", "c",
                           "--cache_dir", "cache", "--max_seq_len", "32", "--batch_size", "4",
                           "--accumulation_steps", "1", "--max_steps", "2",
                           "--log_interval", "1"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(tmp_path / "o" / "pretrain_64_metrics.jsonl"))  # keyed by the weight name
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(math.log(6400), rel=0.05)  # random init: ~ln(vocab)
    assert (tmp_path / "o" / "pretrain_64.pth").is_file()
    assert (tmp_path / "c" / "pretrain_64" / "step_2" / "complete.json").is_file()
    assert any(name.startswith("d.jsonl.pretrain.") for name in os.listdir(tmp_path / "cache"))  # the token cache


@pytest.mark.parametrize("script", [SCRIPT, "trainer/train_sft.py"])
def test_from_weight_takes_the_shapes_of_the_file(tmp_path, script):
    """A .pth of shapes no default has (fp16, as MiniMind saves) starts a run with no model flags at all;
    at lr 0 the weights the run saves are exactly the file's."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=192)
    torch.manual_seed(3)
    state = {k: v.half() for k, v in MiniMindForCausalLM(config).state_dict().items()}
    torch.save(state, tmp_path / "mm.pth")
    data = demo_slice(tmp_path, "sft" if script.endswith("sft.py") else "pretrain", 32)
    proc = forked(script, ["--from_weight", str(tmp_path / "mm.pth"), "--learning_rate", "0", "--dtype", "float32",
                           "--save_dtype", "float32", "--data_path", data, "--max_seq_len", "64", "--batch_size", "4",
                           "--accumulation_steps", "1", "--max_steps", "1", "--save_dir", str(tmp_path / "out"),
                           "--checkpoint_dir", str(tmp_path / "ckpt"), "--save_weight", "w"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("--from_weight"))
    assert "--hidden_size 768 (the weights have 64)" in line and "--head_dim" not in line  # head_dim flag not given
    saved = torch.load(tmp_path / "out" / "w_64.pth")
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k].float()) for k in state)


def test_help_shows_every_default():
    proc = forked(SCRIPT, ["--help"], timeout=120)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for flag, default in [("--seed", "42"), ("--loss_chunk_size", "1024"), ("--save_weight", "pretrain"),
                          ("--packing", "1"), ("--tensorboard_dir", "off"), ("--save_dir", "out/ in the repo"),
                          ("--log_interval", "100, or fewer so that an epoch has at least ten")]:
        # "flag " so that --save_weight is not found inside --save_weights_every; [-1]: the options section
        assert flag in text and f"(default: {default})" in text.split(flag + " ", 2)[-1].split(" --", 1)[0], flag
    options = text.split("options:", 1)[-1].split(" --")
    assert options[1:] and all(option.count("(default") <= 1 for option in options), \
        [option for option in options if option.count("(default") > 1]  # each default once
    assert "(default: None)" not in text  # an unset default says what it means


def expect_rejected(tmp_path, args, needle):
    out = os.path.join(str(tmp_path), "out")
    proc = forked(SCRIPT, [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", out, *args], timeout=120)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("error:") and needle in lines[-1], lines[-3:]
    assert "| loss " not in proc.stdout  # rejected before training: no step was logged


@pytest.mark.parametrize("args,needle", [
    (["--data_path", "/nonexistent/data.jsonl"], "does not exist"),
    (["--max_seq_len", "1"], "--max_seq_len"),
    (["--dtype", "float8"], "--dtype float8 is unknown"),
    (["--hidden_size", "66"], "not divisible"),
    (["--num_key_value_heads", "3"], "num_key_value_heads"),
    (["--use_moe", "1", "--num_experts", "2", "--num_experts_per_tok", "3"], "num_experts_per_tok"),
    (["--from_weight", "/nonexistent/w.pth"], "does not exist"),
    (["--save_dir", "/proc/forbidden"], "not writable"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    expect_rejected(tmp_path, args, needle)


def test_bad_input_second_round(tmp_path):
    """One of issue 10's cases end to end (exit 2, one error line); every flag's range: tests/test_config.py."""
    expect_rejected(tmp_path, ["--learning_rate", "-1"],
                    "--learning_rate must be a finite number, 0 or more (got -1.0)")


def test_garbage_weight_file_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.pth"
    garbage.write_text("not a checkpoint")
    expect_rejected(tmp_path, ["--from_weight", str(garbage)], "is not a torch weight file")


def test_resuming_at_or_past_max_steps_trains_nothing(tmp_path):
    common = ["--data_path", demo_slice(tmp_path, "pretrain", 48), "--packing", "0", "--max_seq_len", "64",
              "--batch_size", "4", "--accumulation_steps", "2"]  # 6 steps per epoch
    records, out = run_pretrain(tmp_path, *common, "--max_steps", "4")
    weights = torch.load(os.path.join(out, "pretrain_64.pth"))
    for max_steps in ("4", "3"):
        again, _ = run_pretrain(tmp_path, *common, "--max_steps", max_steps, "--from_resume", "1")
        assert again == records  # no step trained, none logged again
    proc = forked(SCRIPT, [*TINY_MODEL, *common, "--save_dir", out,
                           "--checkpoint_dir", os.path.join(str(tmp_path), "ckpt"),
                           "--metrics_file", os.path.join(out, "metrics.jsonl"), "--max_steps", "3",
                           "--from_resume", "1"])
    assert proc.returncode == 0
    assert "--max_steps 3: the checkpoint is already at step 4; nothing to train" in proc.stdout
    after = torch.load(os.path.join(out, "pretrain_64.pth"))
    assert all(torch.equal(weights[k], after[k]) for k in weights)


def test_empty_and_malformed_data_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    expect_rejected(tmp_path, ["--data_path", str(empty)], "is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    expect_rejected(tmp_path, ["--data_path", str(bad)], "bad.jsonl:2")


@pytest.mark.skipif(metrics.cpu_bf16_native(), reason="this CPU supports bf16")  # the probe the forked trainer reads
def test_bf16_rejected_on_cpu_without_it(tmp_path):
    expect_rejected(tmp_path, ["--dtype", "bfloat16", "--device", "cpu"], "--dtype bfloat16 is not supported")


def test_validation_loss_matches_an_independent_evaluation(tmp_path):
    """The logged eval loss equals CE computed here without the trainer's data or mask code: the eval file is
    tokenized as bos + text + eos per line, concatenated and cut into rows (packing), and under the default
    --doc_mask 1 each row's document pieces run through the model alone (plain causal, positions from 0)."""
    import json

    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from tests.helpers.launch import ROOT
    train_data = demo_slice(tmp_path, "pretrain", 64)
    eval_data = demo_slice(tmp_path, "pretrain", 100, name="eval.jsonl")
    metrics = os.path.join(str(tmp_path), "out", "metrics.jsonl")
    records, out = run_pretrain(tmp_path, "--data_path", train_data, "--eval_data_path", eval_data,
                                "--eval_interval", "3",
                                "--eval_batches", "4", "--max_seq_len", "64", "--batch_size", "4",
                                "--accumulation_steps", "1", "--max_steps", "6", "--save_dtype", "float32")
    evals = [r for r in map(json.loads, open(metrics)) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]  # every 3 steps; the end (step 6) is not evaluated twice
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config).eval()
    model.load_state_dict(torch.load(os.path.join(out, "pretrain_64.pth")))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    stream, starts = [], []
    for line in open(eval_data):
        starts.append(len(stream))
        stream += [tokenizer.bos_token_id, *tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"],
                   tokenizer.eos_token_id]
    ce_sum = count = 0.0
    with torch.no_grad():
        for row in range(4 * 4):  # --eval_batches 4 of --batch_size 4 rows, in file order (no shuffle)
            begin, end = row * 64, row * 64 + 64
            cuts = sorted({begin, end, *(s for s in starts if begin < s < end)})
            ids = torch.tensor(stream[begin:end])
            logits = torch.cat([model(ids[None, a - begin:b - begin]).logits[0] for a, b in zip(cuts, cuts[1:])])
            ce_sum += F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum").item()
            count += 63
    assert evals[-1]["eval_loss"] == pytest.approx(ce_sum / count, rel=1e-5)
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(ce_sum / count), rel=1e-5)


def test_weighted_mixture_of_sources_resumes_exactly(tmp_path):
    """--data_path a:0.75,dir/*.jsonl:0.25 mixes the sources by weight, says so in one line, and data order stays a
    pure function of (seed, epoch): a run stopped mid-epoch and resumed equals the uninterrupted one."""
    lines = open(demo_slice(tmp_path, "pretrain", 96)).readlines()
    (tmp_path / "b").mkdir()
    (tmp_path / "a.jsonl").write_text("".join(lines[:48]))
    (tmp_path / "b" / "b1.jsonl").write_text("".join(lines[48:72]))
    (tmp_path / "b" / "b2.jsonl").write_text("".join(lines[72:]))
    spec = f"{tmp_path / 'a.jsonl'}:0.75,{tmp_path / 'b'}/*.jsonl:0.25"
    common = ["--data_path", spec, "--packing", "0", "--epochs", "2", "--max_seq_len", "64", "--batch_size", "4",
              "--accumulation_steps", "2", "--learning_rate", "2e-3", "--cache_dir", str(tmp_path / "cache")]
    full, _ = run_pretrain(tmp_path / "full", *common, "--max_steps", "14")
    run_pretrain(tmp_path / "split", *common, "--max_steps", "14", "--max_tokens", str(full[4]["tokens"]))  # step 5
    resumed, _ = run_pretrain(tmp_path / "split", *common, "--max_steps", "14", "--from_resume", "1")
    assert [r["step"] for r in resumed] == list(range(1, 15)) and full[-1]["epoch"] == 1  # crossed an epoch
    for a, b in zip(full, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], (a, b)
    proc = forked(SCRIPT, [*TINY_MODEL, *common, "--max_steps", "1", "--save_dir", str(tmp_path / "o"),
                           "--checkpoint_dir", str(tmp_path / "c")], timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("data mixture realised"))
    assert "72 rows (75.0%)" in line and "24 rows (25.0%)" in line, line  # 96 rows an epoch, split 3:1


def test_from_weight_takes_a_minimind_format_folder(tmp_path):
    """MiniMind's own HF export folder (model_type minimind) starts SFT with no model flags; at lr 0 the weights
    the run saves equal the folder's, and the folder's model is an independent transformers Qwen3."""
    from tests.helpers.weight_files import tiny_qwen3, write_minimind_folder
    reference = tiny_qwen3(vocab=6400)
    folder = write_minimind_folder(tmp_path / "minimind-3", reference)
    proc = forked("trainer/train_sft.py", [
        "--from_weight", str(folder), "--learning_rate", "0", "--dtype", "float32", "--save_dtype", "float32",
        "--data_path", demo_slice(tmp_path, "sft", 32), "--max_seq_len", "64", "--batch_size", "4",
        "--accumulation_steps", "1", "--max_steps", "1", "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--save_weight", "w"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = torch.load(tmp_path / "out" / "w_64.pth")
    expected = reference.state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_corpus_smaller_than_one_global_batch_says_the_flags_that_fit(tmp_path, monkeypatch, capsys):
    """142 documents, one row each, against the default global batch of 32 x 8 = 256: the line names both factors and
    flags that fit (accumulation 1, the largest power-of-two batch leaving 4 steps an epoch: 142 // 4 = 35 -> 32,
    142 // 32 = 4 steps); run with them, the same command trains."""
    data = write_rows(tmp_path / "small.jsonl", [{"text": f"document {i}: a few words of text"} for i in range(142)])
    argv = [*TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "16", "--max_steps", "1",
            "--save_dir", tmp_path / "out", "--checkpoint_dir", tmp_path / "ckpt", "--cache_dir", tmp_path / "cache"]
    code, err = run_in_process(monkeypatch, capsys, train_pretrain, argv)
    assert code == 2 and err == [f"error: {data} has 142 samples, fewer than one global batch (256 = --batch_size 32 "
                                 "x --accumulation_steps 8 x dp 1); pass --batch_size 32 --accumulation_steps 1 "
                                 "(4 steps an epoch; --epochs for more)"]
    fitted = [*argv, "--batch_size", 32, "--accumulation_steps", 1]
    assert run_in_process(monkeypatch, capsys, train_pretrain, fitted)[0] == 0


@pytest.mark.parametrize("samples,micro_batch,dp,flags", [
    (60, 32, 1, "--batch_size 8 --accumulation_steps 1 (7 steps an epoch"),  # 60 // 4 = 15 -> 8; 60 // 8 = 7
    (142, 32, 2, "--batch_size 16 --accumulation_steps 1 (4 steps an epoch"),  # 142 // 8 = 17 -> 16; 142 // 32
    (3, 32, 1, "--batch_size 1 --accumulation_steps 1 (3 steps an epoch"),
    (5, 2, 4, "--batch_size 1 --accumulation_steps 1 (1 step an epoch"),
])
def test_small_batch_by_hand(samples, micro_batch, dp, flags):
    assert small_batch(samples, micro_batch, dp).startswith(f"pass {flags}")
    assert small_batch(3, 32, 4) == "run on at most 3 data-parallel processes"
