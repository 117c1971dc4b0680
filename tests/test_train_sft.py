"""End-to-end SFT: starts from pretrained weights, assistant-only loss, same loop as pretraining."""
import json
import math
import os

import pytest
import torch
from torch.utils.data import DistributedSampler
from transformers import AutoTokenizer

from dataset.chat import SFTDataset
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.chat_rows import GCD_CALLS, GCD_TOOLS, TOOL_CONVERSATION, TOOL_CONVERSATION_PIECES, pieces_to_ids
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics


def test_sft_starts_from_pretrained_weights_and_learns(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    common = [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", ckpt, "--max_seq_len", "64", "--log_interval", "1"]
    pre = forked("trainer/train_pretrain.py", [*common, "--data_path", demo_slice(tmp_path, "pretrain", 64),
                                               "--batch_size", "8", "--accumulation_steps", "1", "--max_steps", "4"])
    assert pre.returncode == 0, pre.stderr[-3000:]
    sft_data = demo_slice(tmp_path, "sft", 200)
    sft = forked("trainer/train_sft.py", [*common, "--data_path", sft_data, "--batch_size", "8", "--max_steps", "15",
                                          "--learning_rate", "3e-3", "--metrics_file", str(tmp_path / "sft.jsonl")])
    assert sft.returncode == 0, sft.stderr[-3000:]
    records = read_metrics(str(tmp_path / "sft.jsonl"))
    assert len(records) == 15

    # independent reference for step 1 (packed by default): the pretrained weights on the conversations of the first
    # batch of (seed 42, epoch 0), each alone and padded: CE summed over them / their target tokens
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(torch.load(os.path.join(out, "pretrain_64.pth")))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    packed = SFTDataset(sft_data, tokenizer, max_length=64, packing=True)
    alone = SFTDataset(sft_data, tokenizer, max_length=64)
    sampler = DistributedSampler(packed, num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=True)
    sampler.set_epoch(0)
    conversations = [int(c) for r in list(sampler)[:8] for c in packed.row_docs[packed.row_offsets[r]:
                                                                                 packed.row_offsets[r + 1]]]
    assert len(conversations) > 8  # the rows do hold several conversations
    input_ids = torch.stack([alone[i][0] for i in conversations])
    labels = torch.stack([alone[i][1] for i in conversations])
    with torch.no_grad():
        expected = model(input_ids, labels=labels).loss.item()
    assert abs(records[0]["loss"] - expected) < 1e-5, (records[0]["loss"], expected)
    assert records[0]["tokens"] == int((labels[:, 1:] != -100).sum())
    assert sum(r["loss"] for r in records[-3:]) / 3 < records[0]["loss"] - 0.5  # it learns the chat data
    assert os.path.exists(os.path.join(out, "full_sft_64.pth"))


def test_sft_without_pretrained_weights_is_rejected(tmp_path):
    proc = forked("trainer/train_sft.py", [*TINY_MODEL, "--save_dir", str(tmp_path), "--checkpoint_dir", str(tmp_path)])
    assert proc.returncode == 2
    assert "pretrain_64.pth does not exist" in proc.stderr.strip().splitlines()[-1]


def test_sft_trains_on_minimind3_tool_rows(tmp_path):
    """An sft_t2t-style file (reasoning, tools, tool calls, tool results; JSON strings and lists) trains: the
    steps see exactly the hand-counted assistant tokens, and the loss starts near ln(vocab) and stays finite."""
    as_lists = [dict(m) for m in TOOL_CONVERSATION]
    as_lists[0]["tools"], as_lists[2]["tool_calls"] = GCD_TOOLS, GCD_CALLS
    data = tmp_path / "sft_t2t.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in [TOOL_CONVERSATION, as_lists] * 4))
    metrics = tmp_path / "m.jsonl"
    proc = forked("trainer/train_sft.py", [
        "--data_path", data, "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
        "--num_key_value_heads", "2", "--max_steps", "2", "--batch_size", "2", "--accumulation_steps", "1",
        "--max_seq_len", "256", "--dtype", "float32", "--from_weight", "none", "--save_dir", tmp_path / "out",
        "--checkpoint_dir", tmp_path / "ckpt", "--metrics_file", metrics, "--log_interval", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(metrics))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    _, labels = pieces_to_ids(tokenizer, TOOL_CONVERSATION_PIECES)
    targets_per_row = sum(label != -100 for label in labels[1:256])  # the trainer shifts labels by one
    assert [r["tokens"] for r in records] == [2 * targets_per_row, 4 * targets_per_row]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["loss"] == pytest.approx(math.log(len(tokenizer)), rel=0.05)  # random init
