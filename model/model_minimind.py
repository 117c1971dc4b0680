"""MiniMind: a small Qwen3-style decoder (dense or MoE) as a Hugging Face PreTrainedModel.

Numerically follows transformers' Qwen3 / Qwen3-MoE (model/hf_convert.py maps weights both ways).
No distributed code: parallelism is applied from outside through the hooks documented in docs/design.md
(`Attention.attn_fn`, the MoE layer's, shape-derived head counts). Two concerns a dense training step does not run live
beside it and are read only where a config asks for them: the MoE layer (model/moe.py, use_moe) and YaRN (model/yarn.py,
inference_rope_scaling); both are imported relatively, so an export's remote code (scripts/convert_model.py) ships them
with this file.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

try:  # FlexAttention (torch >= 2.5): the CUDA document mask, a BlockMask instead of a dense (B, 1, L, L) one
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
except ImportError:
    BlockMask = create_block_mask = create_mask = flex_attention = None
_compiled_flex = None  # torch.compile(flex_attention), made at the first CUDA call (the wrapper's imports cost ~1 s)

try:  # transformers >= 5: init helpers that skip weights already loaded by from_pretrained
    from transformers import initialization as hf_init
except ImportError:  # transformers 4.x
    hf_init = nn.init


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
class MiniMindConfig(PretrainedConfig):
    """MiniMind hyper-parameters: minimind-3's names and defaults (63.9M dense, 198.4M with use_moe).

    Check with `validate()`, never raises here. MoE experts default to intermediate_size, as in minimind-3.
    """

    model_type = "minimind"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        hidden_size=768,
        num_hidden_layers=8,
        vocab_size=6400,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=None,
        intermediate_size=None,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        dropout=0.0,
        flash_attn=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # MoE (ignored when use_moe is False)
        use_moe=False,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=None,
        norm_topk_prob=True,
        router_aux_loss_coef=5e-4,
        n_shared_experts=0,
        loss_chunk_size=0,
        inference_rope_scaling=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.vocab_size = vocab_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        if intermediate_size is None:  # minimind-3's rule: ceil(hidden * pi / 64) * 64 (2432 at 768)
            intermediate_size = math.ceil(hidden_size * math.pi / 64) * 64
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.tie_word_embeddings = tie_word_embeddings
        self.dropout = dropout
        self.flash_attn = flash_attn
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        # set after super().__init__: transformers 5 drops generation ids passed to the base class
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self._set_moe(use_moe, num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
                      router_aux_loss_coef, n_shared_experts)
        # > 0: with labels, lm_head + cross-entropy run over chunks of this many tokens and `logits` is None
        self.loss_chunk_size = loss_chunk_size
        # MiniMind-3's switch for YaRN (YARN_ROPE_SCALING); a plain bool so config.json round-trips it
        self.inference_rope_scaling = bool(inference_rope_scaling)

    def _set_moe(self, use_moe, num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
                 router_aux_loss_coef, n_shared_experts):
        """The MoE fields (ignored when use_moe is False); the experts' size defaults to intermediate_size."""
        self.use_moe = use_moe
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size if moe_intermediate_size is not None \
            else self.intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        self.n_shared_experts = n_shared_experts

    def validate(self):
        """Return a one-line message saying what to change, or None if the config is usable."""
        h, nh, nkv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if nh <= 0 or nkv <= 0:
            return f"num_attention_heads ({nh}) and num_key_value_heads ({nkv}) must be positive"
        if h % nh != 0 and self.head_dim == h // nh:  # head_dim was derived, not chosen
            return f"hidden_size ({h}) must be divisible by num_attention_heads ({nh}), or set head_dim explicitly"
        if nh % nkv != 0:
            return f"num_attention_heads ({nh}) must be divisible by num_key_value_heads ({nkv})"
        if self.head_dim % 2 != 0:
            return f"head_dim ({self.head_dim}) must be even for RoPE"
        if self.num_experts_per_tok > self.num_experts:
            return f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})"
        return None


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as Qwen3RMSNorm)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


def rope_frequencies(head_dim, base):
    """RoPE's inverse frequencies, shape (head_dim/2,), as MiniMind's precompute_freqs_cis computes them."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin for given positions (YaRN where the config asks); inv_freq is recomputed per call (no buffer to
    lose on meta-device init), and the config read then, so setting inference_rope_scaling after loading takes."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    @torch.no_grad()
    def forward(self, x, position_ids):
        c = self.config
        inv_freq, attention_factor = rope_frequencies(c.head_dim, c.rope_theta), 1.0
        if getattr(c, "inference_rope_scaling", False):  # MiniMind-3's YaRN, an inference switch
            from .yarn import yarn_frequencies
            inv_freq, attention_factor = yarn_frequencies(inv_freq, c.head_dim, c.rope_theta,
                                                          c.max_position_embeddings)
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # (B, L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # YaRN's cos/sin scale (MiniMind's is 1.0)
            cos, sin = cos * attention_factor, sin * attention_factor
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x):
    """Rotate half the hidden dims: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Apply RoPE to q/k of shape (B, H, L, D) with cos/sin of shape (B, L, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    """(B, Hkv, L, D) -> (B, Hkv * n_rep, L, D), each kv head repeated for its group of query heads."""
    if n_rep == 1:
        return x
    b, h, length, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, length, d).reshape(b, h * n_rep, length, d)


def prefix_tree(position_ids):
    """(segment, trunk, start) of each token of packed rows (B, L): the segment it belongs to, its document's first
    segment (the trunk) and the position its segment starts at.

    A position id that does not increase starts a segment: at 0 a new document, at p > 0 a branch that continues its
    document's trunk from position p (a prompt run once for several answers: trainer/core/shared_prefix.py)."""
    restart = torch.ones_like(position_ids, dtype=torch.bool)
    restart[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    segment = restart.cumsum(-1)
    document_start = position_ids == 0
    document_start[:, 0] = True  # a row begins a document (or the rest of one cut by the previous row)
    trunk = torch.where(document_start, segment, 0).cummax(-1).values
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    start = position_ids.gather(-1, torch.where(restart, index, 0).cummax(-1).values)
    return segment, trunk, start


def sees(segment, trunk, start, position_ids, b, q, k):
    """Whether query q of row b may attend to key k (k <= q): the same segment, or its document's trunk before the
    position its branch starts at (prefix_tree's fields)."""
    return (segment[b, q] == segment[b, k]) | ((segment[b, k] == trunk[b, q]) & (position_ids[b, k] < start[b, q]))


def document_block_mask(position_ids):
    """FlexAttention BlockMask of packed_document_mask, built once per micro-batch and shared by every layer."""
    segment, trunk, start = prefix_tree(position_ids)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & sees(segment, trunk, start, position_ids, b, q_idx, kv_idx)

    length = position_ids.shape[-1]
    return create_block_mask(mask_mod, position_ids.shape[0], None, length, length, device=position_ids.device)


def packed_document_mask(position_ids):
    """(B, 1, L, L) boolean mask of packed rows, True = attend; the plain causal mask when no position restarts.

    A document starts where its position id restarts at 0 (dataset/lm_dataset.py writes them so); each
    token attends causally to the earlier tokens of its own document only. transformers' Qwen3 builds the
    same mask from such position ids (masking_utils.find_packed_sequence_indices). A position id that steps back to
    p > 0 starts a branch of its document (prefix_tree): its tokens see their own and the document's first segment
    up to position p - 1, as the row [that prefix, the branch] would. Built for every row alike, so no host sync
    decides whether a batch holds several documents. On CUDA a FlexAttention BlockMask of the same mask
    (document_block_mask), so SDPA never gets a dense mask there.
    """
    if position_ids.is_cuda and create_block_mask is not None:
        return document_block_mask(position_ids)
    segment, trunk, start = prefix_tree(position_ids)
    length = position_ids.shape[-1]
    index = torch.arange(length, device=position_ids.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & sees(segment, trunk, start, position_ids, slice(None), index[:, None], index[None, :]))[:, None]


def generation_mask(mask):
    """generate()'s 4-D mask (bool, True = attend, or additive float with 0 = attend) as a boolean mask in which a
    query that may attend to nothing (a padding position) attends everywhere, as build_attention_mask does."""
    mask = mask if mask.dtype == torch.bool else mask == 0
    return mask | ~mask.any(dim=-1, keepdim=True)


# torch's CPU flash-attention kernel (what SDPA calls on CPU); its attn_mask argument exists since torch 2.3. A private
# op, listed in model/torch_compat.py (CPU_FLASH_OP) but looked up here: this file ships as remote code without it
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# it splits keys into blocks of 512 (FlashAttentionKernel.cpp): shorter rows have no block above the diagonal to skip
_CPU_FLASH_KV_BLOCK = 512
# rows shorter than this run SDPA in fp32 under CPU bf16 autocast (short_rows_in_fp32). Forward and backward of one
# layer, 1 thread, AMD EPYC with avx512_bf16 (torch 2.13), bf16 time / fp32 time: 2.3 at 64 positions, 1.7 at 128,
# 1.0 at 256, 0.9 at 384-512, 0.75 at 1024 (4 and 8 heads of 64, causal or a document mask alike)
CPU_FP32_ROWS = 256


def build_attention_mask(lq, lk, attention_mask=None, device=None):
    """Boolean (B or 1, 1, Lq, Lk) mask, True = attend: causal with the KV-cache offset, plus 2-D padding mask.

    Queries are the last Lq of the Lk positions. Rows that would attend to nothing (padding queries) attend
    everywhere instead, so no NaN reaches later layers; their outputs are ignored anyway. A 4-D mask
    (packed_document_mask) is already complete and is returned as it is.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :].bool()
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask


def autocast_dtype(x):
    """The dtype an op on autocast's list gives for x on its device: autocast's where it is on, else x's own."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def autocast_inputs(q, k, v):
    """q, k, v in the autocast dtype where autocast is on: as SDPA (on autocast's list) would get them."""
    if not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = autocast_dtype(q)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def flex_document_attention(q, k, v, block_mask):
    """FlexAttention with a document BlockMask; GQA by enable_gqa (k/v unrepeated). Compiled on CUDA."""
    global _compiled_flex
    q, k, v = autocast_inputs(q, k, v)
    if q.is_cuda and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    flex = _compiled_flex if q.is_cuda else flex_attention  # eager on CPU: the unfused reference, for tests
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def causal_masked_cpu_attention(q, k, v, mask):
    """CPU flash attention with is_causal and a (B, 1, L, L) boolean mask that already holds the causal part.

    SDPA drops is_causal when given a mask, so its kernel also computes every block above the diagonal;
    calling the kernel with both skips them, and only the document mask's entries are added on top.
    """
    q, k, v = autocast_inputs(q, k, v)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return _CPU_FLASH(q, k, v, 0.0, True, attn_mask=bias)[0]


def sdpa_attention(q, k, v, attention_mask=None):
    """Causal attention with torch SDPA. q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D); attention_mask: None, a (B, Lk)
    padding mask of 1/0, or packed_document_mask's (B, 1, L, L) mask."""
    if BlockMask is not None and isinstance(attention_mask, BlockMask):
        return flex_document_attention(q, k, v, attention_mask)
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:  # one new token over the cache: SDPA's own GQA reads the kv heads unrepeated (no copy per step)
        mask = None if attention_mask is None else build_attention_mask(lq, lk, attention_mask, device=q.device)
        if q.device.type == "cpu" and autocast_dtype(q) != torch.float32:
            return one_query_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    if attention_mask is None and lq == lk:  # plain causal: lets SDPA pick the flash kernel
        return short_rows_in_fp32(q, k, v, is_causal=True)
    if attention_mask is not None and attention_mask.dim() == 4 and lq == lk > _CPU_FLASH_KV_BLOCK \
            and q.device.type == "cpu" and _CPU_FLASH is not None:
        return causal_masked_cpu_attention(q, k, v, attention_mask)
    mask = build_attention_mask(lq, lk, attention_mask, device=q.device)
    return short_rows_in_fp32(q, k, v, attn_mask=mask)


def short_rows_in_fp32(q, k, v, **kwargs):
    """SDPA; on CPU under bf16 autocast, queries and keys of one length shorter than CPU_FP32_ROWS run in fp32 (no
    autocast), their output cast back to bf16: torch's CPU flash kernel is slower in bf16 there than in fp32, and fp32
    is the more exact of the two."""
    if q.device.type != "cpu" or q.shape[2] != k.shape[2] or q.shape[2] >= CPU_FP32_ROWS \
            or not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(torch.bfloat16)


def one_query_attention(q, k, v, mask=None):
    """One new token per row over its cached keys (decoding) in bf16 or fp16 on CPU: two matmuls and a softmax in
    fp32, each kv head against its group of query heads (no repeated keys), the result in the dtype SDPA gives
    (autocast's). torch's CPU flash kernel spends ~4x the time in bf16 on one query as in fp32 (AMD EPYC, 96 keys: 270
    against 45 us; 512 keys: 1.6 ms against 0.17); this runs at the fp32 kernel's speed and is the more exact.
    q (B, Hq, 1, D), k/v (B, Hkv, L, D), mask None or boolean (B or 1, 1, 1, L), True = attend."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    dtype = autocast_dtype(q)
    with torch.autocast("cpu", enabled=False):
        scores = (q.float().reshape(b, hkv, hq // hkv, d) * (1.0 / math.sqrt(d))) @ k.float().transpose(-2, -1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v.float()
    return out.reshape(b, hq, 1, d).to(dtype)


def eager_attention(q, k, v, attention_mask=None):
    """Same contract as sdpa_attention, written out (used when config.flash_attn is False)."""
    lq, lk = q.shape[2], k.shape[2]
    if BlockMask is not None and isinstance(attention_mask, BlockMask):  # the dense mask it stands for
        attention_mask = create_mask(attention_mask.mask_mod, attention_mask.shape[0], 1, lq, lk, device=q.device)
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = build_attention_mask(lq, lk, attention_mask, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def cached_keys(cache, k, v, layer_idx, attention_mask=None, cache_position=None):
    """(keys, values, mask) of the cached positions so far plus the new ones, from a transformers KV cache.

    A static cache returns its whole preallocated buffer: the slots not written yet are cut off (and the mask with
    them), so attention sees what a dynamic cache gives. transformers 4.x's StaticCache writes at cache_position."""
    past_len = int(cache.get_seq_length(layer_idx))  # before this update; a host read, in generation only
    kv_len = past_len + k.shape[2]
    cache_kwargs = {"cache_position": cache_position} if cache_position is not None else {}
    k, v = cache.update(k, v, layer_idx, cache_kwargs)
    if k.shape[2] > kv_len:  # a static cache's unwritten slots
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] > kv_len:
        attention_mask = attention_mask[..., :kv_len]
    return k, v, attention_mask


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm (Qwen3) and RoPE; the kernel is the swappable `self.attn_fn`."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx  # index into the KV cache
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attn_fn = sdpa_attention if config.flash_attn else eager_attention

    def forward(self, x, position_embeddings, attention_mask=None, past_key_values=None, use_cache=False,
                cache_position=None):
        bsz, seq_len, _ = x.shape
        # head counts come from the shapes, so tensor parallel can shard the projections by heads
        q = self.q_norm(self.q_proj(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v, attention_mask = cached_keys(past_key_values, k, v, self.layer_idx, attention_mask, cache_position)
        out = self.attn_fn(q, k, v, attention_mask)
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.resid_dropout(self.o_proj(out))


class FeedForward(nn.Module):
    """SwiGLU MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MiniMindBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, layer_id, config):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(config, layer_idx=layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.use_moe:  # model/moe.py: read by MoE models only
            from .moe import MOEFeedForward
            self.mlp = MOEFeedForward(config, FeedForward)
        else:
            self.mlp = FeedForward(config)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                use_cache=False, cache_position=None):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask,
            past_key_values, use_cache, cache_position)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MiniMindModel(nn.Module):
    """Embeddings + decoder blocks + final norm. Returns (hidden_states, past_key_values, aux_loss)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([MiniMindBlock(i, config) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.document_mask = packed_document_mask  # context parallel swaps it: its ring masks by positions

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, inputs_embeds=None, cache_position=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is not None and attention_mask.dim() == 4 and past_key_values is not None:
            attention_mask = generation_mask(attention_mask)  # generate()'s full mask over a static cache
        elif attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be a 2-D (batch, kv_len) padding mask, "
                                 f"got {attention_mask.dim()}-D")
            if bool(attention_mask.all()):  # generation without padding keeps the causal kernel (never in training)
                attention_mask = None
        elif past_key_values is None and position_ids is not None:
            # packed rows (the trainer passes position ids only for document-masked rows, a static choice): a mask for
            # every batch alike, so no host sync asks whether it holds several documents and the compiled graph is one
            attention_mask = self.document_mask(position_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if position_ids is None and cache_position is not None:  # transformers 4.x's generate passes it
            position_ids = cache_position.unsqueeze(0)
        elif position_ids is None:
            past_len = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
            position_ids = torch.arange(past_len, past_len + inputs_embeds.shape[1],
                                        device=inputs_embeds.device).unsqueeze(0)

        hidden_states = self.dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, past_key_values,
                                  use_cache, cache_position)
        hidden_states = self.norm(hidden_states)
        aux_loss = sum((layer.mlp.aux_loss for layer in self.layers if self.config.use_moe),  # MOEFeedForward's
                       torch.zeros((), device=hidden_states.device))
        return hidden_states, past_key_values, aux_loss


# ----------------------------------------------------------------------------------------------
# Chunked lm_head + cross-entropy (the loss path without full-batch logits)
# ----------------------------------------------------------------------------------------------
class _ChunkedHead(torch.autograd.Function):
    """`loss.total()` over the rows of `hidden @ weight.T`, a chunk of rows at a time; gradients are formed in forward.

    `loss.chunk(logits, start)` takes one chunk's fp32 logits (rows start, start + 1, ...), adds the chunk's terms to
    its sums and returns d(total)/d(logits) in fp32. Only one chunk's logits exist at a time, and backward just scales
    the stored gradients, so no logits are kept or recomputed (the idea of Liger-Kernel's fused linear
    cross-entropy). Under autocast the matmuls run in the autocast dtype, as the unchunked `lm_head` would. Serves
    the model's CE (CrossEntropyChunks) and distillation's KL + CE (trainer/stages/distillation.py).
    """

    @staticmethod
    def forward(ctx, hidden, weight, loss, chunk_size):
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            grad_logits = loss.chunk(F.linear(h, weight).float(), start)  # it holds the only reference to the logits
            grad_logits = grad_logits.to(weight.dtype)  # as the lm_head backward sees it (autocast casts in mm)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk_size] = torch.mm(grad_logits, weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += torch.mm(grad_logits.t().to(h.dtype), h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss.total()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        grad_weight = grad_weight * grad_output if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None


def chunked_head(hidden, weight, loss, chunk_size):
    """`loss.total()` of the rows hidden (N, H) against the lm_head `weight` (V, H), in chunks of `chunk_size` rows,
    differentiable in hidden and weight (see _ChunkedHead for what `loss` provides)."""
    return _ChunkedHead.apply(hidden, weight, loss, chunk_size)


class CrossEntropyChunks:
    """Summed cross-entropy of rows against `targets`, one chunk of logits at a time (the loss of chunked_head)."""

    def __init__(self, targets, chunk_size):
        self.targets, self.chunk_size = targets, chunk_size
        self.ce_sum = torch.zeros((), dtype=torch.float32, device=targets.device)
        self.rows = torch.arange(min(chunk_size, targets.shape[0]), device=targets.device)

    def chunk(self, logits, start):
        """Adds the chunk's CE to ce_sum; returns d(sum CE)/d logits = softmax - one_hot(target)."""
        t = self.targets[start:start + self.chunk_size]
        self.ce_sum += F.cross_entropy(logits, t, reduction="sum")
        grad_logits = torch.softmax(logits, dim=-1)
        del logits
        grad_logits[self.rows[:len(t)], t] -= 1
        return grad_logits

    def total(self):
        return self.ce_sum


def chunked_cross_entropy(hidden, weight, targets, chunk_size):
    """sum over targets != -100 of CE(hidden @ weight.T, target), never materialising all logits at once.

    hidden (..., H), weight (V, H), targets (...) with -100 = ignore. Ignored positions (padding) are
    dropped before the lm_head, so they cost no matmul.
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = (targets != -100).nonzero().squeeze(1)
    hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return chunked_head(hidden, weight, CrossEntropyChunks(targets, chunk_size), chunk_size)
    ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):  # no grad needed: plain chunked loop
        logits = F.linear(hidden[start:start + chunk_size], weight).float()
        ce_sum += F.cross_entropy(logits, targets[start:start + chunk_size], reduction="sum")
    return ce_sum


# ----------------------------------------------------------------------------------------------
# Causal LM
# ----------------------------------------------------------------------------------------------
# the output's KV-cache field: `cache` from transformers 5.24 on (generate reads it back), else past_key_values
CACHE_FIELD = "cache" if "cache" in MoeCausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# generate()'s bookkeeping keywords, which the model has no use for (the cache position is taken above)
IGNORED_FORWARD_KWARGS = {"return_dict", "output_attentions", "output_hidden_states", "output_router_logits"}


class MiniMindForCausalLM(PreTrainedModel, GenerationMixin):
    """MiniMind language model; `generate()` comes from transformers' GenerationMixin (DynamicCache)."""

    config_class = MiniMindConfig
    base_model_prefix = "model"
    _no_split_modules = ["MiniMindBlock"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _supports_sdpa = True

    def __init__(self, config=None):
        config = config or MiniMindConfig()
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:  # one Parameter under both names
            self.model.embed_tokens.weight = self.lm_head.weight
        self.post_init()

    def _init_weights(self, module):
        """Normal(0, initializer_range) for Linear/Embedding, ones for RMSNorm."""
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            hf_init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            hf_init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, labels=None, shift_labels=None, num_items_in_batch=None, logits_to_keep=0,
                inputs_embeds=None, cache=None, cache_position=None, **kwargs):
        """Causal LM forward. The KV cache comes as `past_key_values` (transformers < 5.24) or `cache` (>= 5.24's
        generate); any other keyword that is not one of generate()'s bookkeeping flags is an error, never dropped."""
        unknown = set(kwargs) - IGNORED_FORWARD_KWARGS
        if unknown:
            raise TypeError(f"MiniMindForCausalLM.forward got unexpected arguments {sorted(unknown)}")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the KV cache once, as cache or past_key_values")
        past_key_values = past_key_values if past_key_values is not None else cache
        hidden_states, past_key_values, aux_loss = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, inputs_embeds=inputs_embeds,
            cache_position=cache_position)
        loss = logits = None
        if shift_labels is None and labels is not None:  # targets[t] = labels[t + 1], -100 at the end
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        if self._use_chunked_loss(hidden_states, shift_labels, logits_to_keep):
            ce_sum = chunked_cross_entropy(hidden_states, self.lm_head.weight, shift_labels,
                                           self.config.loss_chunk_size)
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :])
            if shift_labels is not None:
                ce_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                         ignore_index=-100, reduction="sum")
        if shift_labels is not None:
            if num_items_in_batch is None:
                num_items_in_batch = (shift_labels != -100).sum().clamp(min=1)
            loss = ce_sum / num_items_in_batch
        cache_out = {CACHE_FIELD: past_key_values if use_cache or past_key_values is not None else None}
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **cache_out)

    def _use_chunked_loss(self, hidden_states, shift_labels, logits_to_keep):
        """Chunked CE only for a loss-only call on plain tensors: tensor parallel (DTensor) keeps the full path."""
        lm_head = self.lm_head
        return (getattr(self.config, "loss_chunk_size", 0) > 0 and shift_labels is not None
                and isinstance(logits_to_keep, int) and logits_to_keep == 0
                and type(lm_head) is nn.Linear and not lm_head._forward_hooks and not lm_head._forward_pre_hooks
                and not hasattr(lm_head.weight, "placements") and not hasattr(hidden_states, "placements"))


try:  # lets AutoConfig / AutoModelForCausalLM resolve model_type "minimind"
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoConfig.register("minimind", MiniMindConfig)
    AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM)
except ValueError:  # already registered (module imported under two names)
    pass
