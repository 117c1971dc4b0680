"""Weights files the format tests share: a tiny Qwen3 and MiniMind Hugging Face folders, LoRA adapters, folded
weights; and a tokenizer wider than model/'s (the model's vocab_size follows it)."""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from model.lora import apply_lora, save_lora
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

QWEN_VOCAB = 512  # the tiny Qwen3's own vocabulary (no tokenizer copied)


def tiny_qwen3(vocab=QWEN_VOCAB):
    """A seeded tiny dense transformers Qwen3 (the independent reference for MiniMind-format folders)."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                                        rms_norm_eps=1e-6, tie_word_embeddings=True)).eval()


def write_minimind_folder(folder, reference):
    """Write `reference` (a tiny dense Qwen3) as MiniMind's export does: its config field names, tied lm_head left
    out."""
    cfg = reference.config
    folder.mkdir()
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="minimind", architectures=["MiniMindForCausalLM"], hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, use_moe=False, vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        rope_parameters=dict(rope_type="default", rope_theta=1e6), rms_norm_eps=1e-6, tie_word_embeddings=True,
        inference_rope_scaling=False, rope_scaling=None, flash_attn=True, num_experts=4, num_experts_per_tok=1,
        moe_intermediate_size=cfg.intermediate_size, router_aux_loss_coef=5e-4,
        auto_map={"AutoModelForCausalLM": "model_minimind.MiniMindForCausalLM"})))
    return folder


VOCAB = 6400  # the tokenizers copied are model/'s


def tiny(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                initializer_range=0.1)
    return MiniMindConfig(**dict(base, **kw))


def source_model(config, seed=0):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config).eval()


def lora_adapter(tmp_path, config, seed=3):
    """A trained-looking adapter (non-zero A and B, scale 2) in MiniMind's format, from model/lora.py."""
    model = source_model(config)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora." in name:
            torch.nn.init.normal_(param, std=0.1)
    save_lora(model, tmp_path / "lora_medical_64.pth")
    return tmp_path / "lora_medical_64.pth"


def hand_folded(weight_path, adapter_path, config):
    """An independent plain model with W + B @ A added here (MiniMind's file: B already holds the scale)."""
    state, adapter = torch.load(weight_path), torch.load(adapter_path)
    for key in [k for k in adapter if k.endswith(".lora.A.weight")]:
        module = key.removesuffix(".lora.A.weight")
        state[f"{module}.weight"] = state[f"{module}.weight"] + adapter[f"{module}.lora.B.weight"] @ adapter[key]
    model = MiniMindForCausalLM(config).eval()
    model.load_state_dict(state)
    return model


MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "model")


def wider_tokenizer(folder, extra):
    """model/'s tokenizer with `extra` added tokens after its 6,400 ids (6400 .. 6400 + extra - 1)."""
    os.makedirs(folder)
    with open(os.path.join(MODEL_DIR, "tokenizer.json"), encoding="utf-8") as f:
        state = json.load(f)
    state["added_tokens"] += [{"id": 6400 + i, "content": f"<|extra{i}|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True} for i in range(extra)]
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(state, f)
    shutil.copy(os.path.join(MODEL_DIR, "tokenizer_config.json"), folder)
    return str(folder)
