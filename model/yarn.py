"""YaRN, MiniMind-3's `inference_rope_scaling`: RoPE's low frequencies stretched so that a model trained on short rows
reads longer ones at inference. model/model_minimind.py RotaryEmbedding reads this file only for a config that sets the
switch (training never does); model/hf_convert.py writes the same dict as a Qwen3 config's rope scaling.

Imported relatively by model/model_minimind.py, as scripts/convert_model.py ships both files as an export's remote code.
"""
import math

import torch

# MiniMind-3's YaRN parameters (its MiniMindConfig.rope_scaling when inference_rope_scaling is set); transformers'
# rope_type "yarn" reads the same keys, so an export writes this dict as the Qwen3 config's rope scaling
YARN_ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 2048,
                     "attention_factor": 1.0, "type": "yarn"}


def rope_scaling_of(config):
    """The YaRN dict the config asks for (MiniMind's `inference_rope_scaling`), or None for plain RoPE."""
    return dict(YARN_ROPE_SCALING) if getattr(config, "inference_rope_scaling", False) else None


def yarn_frequencies(inv_freq, head_dim, base, max_positions, rope_scaling=YARN_ROPE_SCALING):
    """(inv_freq, attention factor) of plain RoPE's `inv_freq` under YaRN, as MiniMind's precompute_freqs_cis computes
    them: f'(i) = f(i) * ((1 - r) + r / factor), r a linear ramp over the dims between the corrections of beta_fast and
    beta_slow rotations at original_max_position_embeddings; applied only when max_positions exceeds that length."""
    original = rope_scaling.get("original_max_position_embeddings", 2048)
    factor = rope_scaling.get("factor", 16)
    attention_factor = rope_scaling.get("attention_factor", 1.0)
    if max_positions / original > 1.0:
        def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times into `original` positions
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction_dim(rope_scaling.get("beta_fast", 32.0))), 0)
        high = min(math.ceil(correction_dim(rope_scaling.get("beta_slow", 1.0))), head_dim // 2 - 1)
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float) - low) / max(high - low, 0.001), 0, 1)
        inv_freq = inv_freq * (1 - ramp + ramp / factor)
    return inv_freq, attention_factor
