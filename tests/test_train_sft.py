"""End-to-end SFT: starts from pretrained weights, assistant-only loss, same loop as pretraining."""
import os

import torch
from torch.utils.data import DistributedSampler
from transformers import AutoTokenizer

from dataset.lm_dataset import SFTDataset
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.launch import ROOT, TINY_MODEL, demo_slice, python, read_metrics


def test_sft_starts_from_pretrained_weights_and_learns(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    common = [*TINY_MODEL, "--save_dir", out, "--checkpoint_dir", ckpt, "--max_seq_len", "64", "--log_interval", "1"]
    pre = python("trainer/train_pretrain.py", [*common, "--data_path", demo_slice(tmp_path, "pretrain", 64),
                                               "--batch_size", "8", "--accumulation_steps", "1", "--max_steps", "4"])
    assert pre.returncode == 0, pre.stderr[-3000:]
    sft_data = demo_slice(tmp_path, "sft", 200)
    sft = python("trainer/train_sft.py", [*common, "--data_path", sft_data, "--batch_size", "8", "--max_steps", "15",
                                          "--learning_rate", "3e-3", "--metrics_file", str(tmp_path / "sft.jsonl")])
    assert sft.returncode == 0, sft.stderr[-3000:]
    records = read_metrics(str(tmp_path / "sft.jsonl"))
    assert len(records) == 15

    # independent reference for step 1: the pretrained weights on the first batch of (seed 42, epoch 0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(torch.load(os.path.join(out, "pretrain_64.pth")))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    dataset = SFTDataset(sft_data, tokenizer, max_length=64)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=True)
    sampler.set_epoch(0)
    first = list(sampler)[:8]
    input_ids = torch.stack([dataset[i][0] for i in first])
    labels = torch.stack([dataset[i][1] for i in first])
    with torch.no_grad():
        expected = model(input_ids, labels=labels).loss.item()
    assert abs(records[0]["loss"] - expected) < 1e-5, (records[0]["loss"], expected)
    assert sum(r["loss"] for r in records[-3:]) / 3 < records[0]["loss"] - 0.5  # it learns the chat data
    assert os.path.exists(os.path.join(out, "full_sft_64.pth"))


def test_sft_without_pretrained_weights_is_rejected(tmp_path):
    proc = python("trainer/train_sft.py", [*TINY_MODEL, "--save_dir", str(tmp_path), "--checkpoint_dir", str(tmp_path)])
    assert proc.returncode == 2
    assert "pretrain_64.pth does not exist" in proc.stderr.strip().splitlines()[-1]
