"""Tiny MiniMind models and the batches, comparisons and transformers twins the model tests share."""
import os

import torch
from torch.utils.data import DistributedSampler
from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from dataset.chat import SFTDataset
from model.hf_convert import minimind_to_hf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import ROOT

VOCAB = 512


def tiny_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, rope_theta=10000.0, initializer_range=0.1)
    base.update(kw)
    return MiniMindConfig(**base)


def minimind(config, seed=0):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config).eval()


def to_hf_model(model):
    """Convert MiniMind weights into the transformers reference model (eager attention, independent of SDPA)."""
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    hf_config._attn_implementation = "eager"
    cls = Qwen3MoeForCausalLM if model.config.use_moe else Qwen3ForCausalLM
    hf = cls(hf_config).eval()
    hf.load_state_dict(hf_sd, strict=True)
    return hf


def batch(bsz=2, seq=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (bsz, seq), generator=g)


def max_diff(a, b, where=None):
    d = (a - b).abs()
    return (d[where] if where is not None else d).max().item()


# ----------------------------------------------------------------------------------------------
# Packed rows: position ids that restart at 0 start a new document (document masking)
# ----------------------------------------------------------------------------------------------
DOC_LENGTHS = (11, 16, 5)


def packed_row(lengths=DOC_LENGTHS):
    """(one row of several random documents, its position ids restarting at each document, the documents)."""
    docs = [batch(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return torch.cat(docs, dim=1), positions, docs


def sft_batch(data, n=4, seq_len=64):
    """The first n rows of the seed-42 epoch-0 order, as the trainer draws them (assistant-only labels)."""
    dataset = SFTDataset(data, AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")), max_length=seq_len)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=True)
    rows = [dataset[i] for i in list(sampler)[:n]]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
