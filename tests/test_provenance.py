"""Weights carry their tokenizer (model/provenance.py): a run records the tokenizer it used beside its weights, and
the export (convert_model.py), evaluation (eval_llm.py) and --from_weight take that one; another one passed by hand
is one line (--force_tokenizer 1 takes it anyway)."""
import argparse
import hashlib
import json
import os
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.provenance import content_sha256
from model.tokenizer_choice import TokenizerMismatch, model_vocab_size, tokenizer_for, tokenizer_ids
from scripts.convert_model import main as convert_main
from scripts.eval_llm import main as eval_main
from scripts.eval_llm import parse_args as eval_args
from scripts.inference.load import tokenizer_folder
from tests.helpers.launch import ROOT, TINY_CONFIG, TINY_MODEL, demo_slice, forked
from tests.helpers.weight_files import wider_tokenizer
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve

MODEL_DIR = os.path.join(ROOT, "model")


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def other_tokenizer(folder):
    """model/'s tokenizer with one added token renamed (<|buffer9|> -> <|custom9|>, id 35): the same vocabulary size,
    so nothing but the files tells it from model/'s, and "<|custom9|>" is one token only here."""
    os.makedirs(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(MODEL_DIR, name)) as f:
            text = f.read()
        with open(os.path.join(folder, name), "w") as f:
            f.write(text.replace("<|buffer9|>", "<|custom9|>"))
    return str(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step pretraining run with the other tokenizer: (its tokenizer folder, its weights, the work dir)."""
    tmp_path = tmp_path_factory.mktemp("provenance")
    tok = other_tokenizer(tmp_path / "my_tokenizer")
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--tokenizer_path", tok, "--data_path", demo_slice(tmp_path, "pretrain", 8), "--max_seq_len",
        "32", "--batch_size", "4", "--accumulation_steps", "1", "--max_steps", "2", "--save_dir", tmp_path / "out",
        "--checkpoint_dir", tmp_path / "ckpt", "--metrics_file", tmp_path / "m.jsonl"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tok, str(tmp_path / "out" / "pretrain_64.pth"), tmp_path


def test_the_sidecar_records_the_tokenizer_and_the_step(trained):
    tok, weights, _ = trained
    with open(weights[:-len(".pth")] + ".json") as f:
        sidecar = json.load(f)
    assert sidecar["tokenizer"] == {"path": tok, "sha256": sha256_of(os.path.join(tok, "tokenizer.json"))}
    assert sidecar["step"] == 2
    assert sha256_of(os.path.join(tok, "tokenizer.json")) != sha256_of(os.path.join(MODEL_DIR, "tokenizer.json"))


def test_the_export_carries_the_run_s_tokenizer(trained, capsys):
    tok, weights, tmp_path = trained
    out = tmp_path / "hf"
    assert convert_main(["--weight", weights, "--out_dir", str(out)]) == 0  # the README's command, no tokenizer flag
    exported = sha256_of(out / "tokenizer.json")
    assert exported == sha256_of(os.path.join(tok, "tokenizer.json"))
    assert exported != sha256_of(os.path.join(MODEL_DIR, "tokenizer.json"))
    capsys.readouterr()
    # model/'s tokenizer by hand: one line naming both; --force_tokenizer 1 copies it anyway
    assert convert_main(["--weight", weights, "--out_dir", str(tmp_path / "hf2"), "--tokenizer_path", MODEL_DIR]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --tokenizer_path {MODEL_DIR} (tokenizer.json sha256 ") and "\n" not in err, err
    assert f"is not the tokenizer --weight {weights} was trained with ({tok}, sha256 " in err
    assert convert_main(["--weight", weights, "--out_dir", str(tmp_path / "hf3"), "--tokenizer_path", MODEL_DIR,
                         "--force_tokenizer", "1"]) == 0
    assert sha256_of(tmp_path / "hf3" / "tokenizer.json") == sha256_of(os.path.join(MODEL_DIR, "tokenizer.json"))
    # the run's resume checkpoint records it too
    assert convert_main(["--weight", str(tmp_path / "ckpt" / "pretrain_64" / "step_2"), "--out_dir",
                         str(tmp_path / "hf4")]) == 0
    assert sha256_of(tmp_path / "hf4" / "tokenizer.json") == sha256_of(os.path.join(tok, "tokenizer.json"))


def test_eval_takes_the_recorded_tokenizer(trained, capsys):
    tok, weights, tmp_path = trained
    assert tokenizer_folder(eval_args(["--weight", weights]), weights) == tok
    checkpoint = str(tmp_path / "ckpt" / "pretrain_64" / "step_2")
    assert tokenizer_folder(eval_args(["--checkpoint", checkpoint]), checkpoint) == tok
    assert f"--checkpoint {checkpoint} was trained with the tokenizer {tok}: using it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        eval_main(["--weight", weights, "--tokenizer_path", MODEL_DIR, "--prompt", "hi", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith(f"error: --tokenizer_path {MODEL_DIR} (") and "\n" not in err


def sft_args(*flags):
    return add_train_args(argparse.ArgumentParser()).parse_args([*TINY_MODEL, "--save_weight", "full_sft", *flags])


def test_from_weight_takes_the_recorded_tokenizer(trained, tmp_path):
    tok, weights, _ = trained
    save = ["--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt")]
    plan = resolve(sft_args("--from_weight", weights, *save), 1)
    assert plan.data.tokenizer_path == tok and plan.data.tokenizer_record["sha256"] == sha256_of(os.path.join(tok,
                                                                                                  "tokenizer.json"))
    with pytest.raises(ConfigError) as caught:
        resolve(sft_args("--from_weight", weights, "--tokenizer_path", MODEL_DIR, *save), 1)
    assert str(caught.value).endswith("leave --tokenizer_path out to use that one, or pass --force_tokenizer 1 to "
                                      "use this one anyway")
    forced = resolve(sft_args("--from_weight", weights, "--tokenizer_path", MODEL_DIR, "--force_tokenizer", "1",
                              *save), 1)
    assert forced.data.tokenizer_path == MODEL_DIR
    # the recorded folder moved away: a copy with the same tokenizer.json (found by hash) is not enough unless typed
    moved = str(tmp_path / "moved")
    shutil.copytree(tok, moved)
    assert resolve(sft_args("--from_weight", weights, "--tokenizer_path", moved, *save), 1).data.tokenizer_path == moved


def test_tokenizer_for_by_hand(tmp_path):
    """The rule, case by case: the hash decides, the recorded folder or model/ when nothing is typed."""
    model_sha = content_sha256(os.path.join(MODEL_DIR, "tokenizer.json"))
    other = other_tokenizer(tmp_path / "other")
    other_sha = content_sha256(os.path.join(other, "tokenizer.json"))
    assert tokenizer_for({"path": other, "sha256": other_sha}, None, MODEL_DIR, "w") == (
        other, f"w was trained with the tokenizer {other}: using it")
    assert tokenizer_for({"path": "/gone", "sha256": model_sha}, None, MODEL_DIR, "w") == (MODEL_DIR, None)
    assert tokenizer_for(None, None, MODEL_DIR, "w")[0] == MODEL_DIR
    assert tokenizer_for({"path": "/gone", "sha256": None}, other, MODEL_DIR, "w") == (other, None)  # no hash: typed
    with pytest.raises(TokenizerMismatch, match=r"^w was trained with the tokenizer /gone \(tokenizer.json sha256 "
                                                r"[0-9a-f]{12}\), which is not found here; pass --tokenizer_path"):
        tokenizer_for({"path": "/gone", "sha256": other_sha}, None, MODEL_DIR, "w")
    shutil.copy(os.path.join(MODEL_DIR, "tokenizer.json"), os.path.join(other, "tokenizer.json"))  # changed since
    with pytest.raises(TokenizerMismatch, match="which has changed; pass --tokenizer_path"):
        tokenizer_for({"path": other, "sha256": other_sha}, None, MODEL_DIR, "w")


def test_the_model_s_vocab_size_follows_the_tokenizer(tmp_path):
    """vocab_size = the tokenizer's ids rounded up to a multiple of 64, by hand: model/'s 6,400 ids stay MiniMind's
    6,400 rows; 6,401 ids take 6,464 (101 x 64); 353 ids (a BPE of 353 tokens) take 384 (6 x 64)."""
    from scripts.train_tokenizer import tokenizer_config, train_tokenizer
    assert model_vocab_size(MODEL_DIR) == 6400 and tokenizer_ids(MODEL_DIR) == 6400
    wide = wider_tokenizer(tmp_path / "wide", 1)
    assert AutoTokenizer.from_pretrained(wide).convert_tokens_to_ids("<|extra0|>") == 6400
    assert (tokenizer_ids(wide), model_vocab_size(wide)) == (6401, 6464)
    small = tmp_path / "small"
    small.mkdir()
    texts = [f"document {i}: the quick brown fox" for i in range(50)]
    (small / "tokenizer.json").write_text(train_tokenizer(texts, 353).to_str())
    (small / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    assert len(AutoTokenizer.from_pretrained(small)) == 353 and model_vocab_size(small) == 384
    save = ["--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt")]
    for folder, rows in ((None, 6400), (wide, 6464), (str(small), 384)):  # the plan's model, as the trainer builds it
        typed = ["--tokenizer_path", folder] if folder else []
        plan = resolve(add_train_args(argparse.ArgumentParser()).parse_args([*TINY_MODEL, *typed, *save]), 1)
        assert plan.model.config.vocab_size == rows


def test_a_tokenizer_wider_than_the_weights_is_refused(tmp_path, capsys):
    """A later stage keeps its --from_weight file's rows; a tokenizer with ids past them (here: weights without a
    sidecar, so nothing records their tokenizer) is one line before training, not an IndexError in the embedding;
    so is a chat on them (eval_llm, the server and the web chat load through the same loader)."""
    config = MiniMindConfig(**TINY_CONFIG)
    weights = str(tmp_path / "pretrain_64.pth")
    torch.save(MiniMindForCausalLM(config).state_dict(), weights)
    wide = wider_tokenizer(tmp_path / "wide", 1)
    save = ["--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt")]
    assert resolve(sft_args("--from_weight", weights, *save), 1).model.config.vocab_size == 6400
    with pytest.raises(ConfigError) as caught:
        resolve(sft_args("--from_weight", weights, "--tokenizer_path", wide, *save), 1)
    assert str(caught.value) == (f"--tokenizer_path {wide} has 6401 token ids but --from_weight {weights} has 6400 "
                                 "embedding rows: pass the tokenizer those weights were trained with, or pretrain "
                                 "with this one (the model's vocab_size follows its tokenizer)")
    with pytest.raises(SystemExit) as caught:
        eval_main(["--weight", weights, "--tokenizer_path", wide, "--prompt", "hi", "--device", "cpu"])
    assert caught.value.code == 2 and capsys.readouterr().err.strip().endswith(
        f"error: --tokenizer_path {wide} has 6401 token ids but {weights} has 6400 embedding rows: pass the "
        "tokenizer those weights were trained with, or pretrain with this one (the model's vocab_size follows its "
        "tokenizer)")
