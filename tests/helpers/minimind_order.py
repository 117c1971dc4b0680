"""MiniMind's own resume order: its sampler order, batches and cosine schedule, written from its train_pretrain.py."""
import math

import torch
from torch import nn
from torch.func import functional_call

from model.model_minimind import MiniMindForCausalLM


def _linear(fan_in, fan_out):
    return nn.Linear(fan_in, fan_out, bias=False)


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm, self.k_norm = Norm(c.head_dim), Norm(c.head_dim)


class FeedForward(nn.Module):
    def __init__(self, c, intermediate_size=None):
        super().__init__()
        inner = intermediate_size or c.intermediate_size
        self.gate_proj = _linear(c.hidden_size, inner)
        self.down_proj = _linear(inner, c.hidden_size)  # MiniMind registers down_proj before up_proj
        self.up_proj = _linear(c.hidden_size, inner)


class MOEFeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = _linear(c.hidden_size, c.num_experts)
        self.experts = nn.ModuleList([FeedForward(c, c.moe_intermediate_size) for _ in range(c.num_experts)])


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.input_layernorm, self.post_attention_layernorm = Norm(c.hidden_size), Norm(c.hidden_size)
        self.mlp = MOEFeedForward(c) if c.use_moe else FeedForward(c)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.num_hidden_layers)])
        self.norm = Norm(c.hidden_size)


class MiniMindOrder(nn.Module):
    """MiniMindForCausalLM's parameters in MiniMind's order; forward() is our model's on these tensors (by name)."""

    def __init__(self, c):
        super().__init__()
        self.model = Model(c)
        self.lm_head = _linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight
        self.ours = [MiniMindForCausalLM(c)]  # in a list: not a submodule, its own parameters are never used

    def loss(self, input_ids, labels):
        """Mean CE over the targets (labels shifted left by one, as MiniMind's forward does) + the MoE aux loss."""
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        params = dict(self.named_parameters(remove_duplicate=False))
        out = functional_call(self.ours[0], params, (input_ids,), dict(
            shift_labels=targets, num_items_in_batch=int((targets != -100).sum())))
        return out.loss + out.aux_loss


def batches(config, count, seed=0, rows=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, config.vocab_size, (rows, seq), generator=g) for _ in range(count)]


def cosine_lr(lr, step, total):
    """MiniMind's get_lr: lr * (0.1 + 0.45 * (1 + cos(pi * step / total)))."""
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
