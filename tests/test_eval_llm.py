"""scripts/eval_llm.py generates from saved weights: its greedy output equals transformers' greedy decode."""
import os

import torch
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.launch import ROOT, python


def test_eval_llm_streams_the_greedy_continuation(tmp_path):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config).eval()
    torch.save(model.state_dict(), tmp_path / "pretrain_64.pth")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    prompt = "The Python interpreter"
    ids = tokenizer(tokenizer.bos_token + prompt, return_tensors="pt", add_special_tokens=False).input_ids
    # independent greedy decode without KV cache: argmax over the full forward, token by token
    for _ in range(12):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    expected = tokenizer.decode(ids[0, -12:], skip_special_tokens=True)
    proc = python("scripts/eval_llm.py", ["--save_dir", str(tmp_path), "--weight", "pretrain", "--hidden_size", "64",
                                          "--num_hidden_layers", "2", "--num_attention_heads", "4",
                                          "--num_key_value_heads", "2", "--prompt", prompt, "--temperature", "0",
                                          "--max_new_tokens", "12", "--device", "cpu"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expected.strip() and expected.strip() in proc.stdout, (expected, proc.stdout)
