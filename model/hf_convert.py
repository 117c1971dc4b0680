"""MiniMind <-> Hugging Face Qwen3 / Qwen3-MoE: the folder's reader (read_hf_folder, also MiniMind's own
`model_type: minimind` folders) and writer (save_hf_folder), and the weight and config mapping both ways.

transformers 4.x stores Qwen3-MoE experts as per-expert Linear layers named like MiniMind's; 5.x fuses them into 3-D
gate_up_proj / down_proj parameters: both are read and the installed version's layout is written.
"""
import json
import os

import torch

from model.model_minimind import MiniMindConfig
from model.weights.shapes import WeightsError, clean_state_dict, config_fields
from model.yarn import YARN_ROPE_SCALING, rope_scaling_of


def _read_safetensors(folder):
    """All tensors of model.safetensors (or its shards listed in model.safetensors.index.json)."""
    from safetensors.torch import load_file  # ships with transformers
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{folder} has no model.safetensors; export the folder with save_pretrained")
    state_dict = {}
    for name in files:
        state_dict.update(load_file(os.path.join(folder, name)))
    return state_dict


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")


def _rope(config):
    """(rope_theta, inference_rope_scaling) of a config dict or object: 4.x writes `rope_theta` + `rope_scaling`, 5.x
    `rope_parameters`. Plain RoPE and MiniMind-3's YaRN (YARN_ROPE_SCALING) convert; any other scaling is refused."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", get("rope_theta"))
    theta = 1e6 if theta is None else float(theta)
    if rope_type == "default":
        return theta, False
    if rope_type == "yarn" and all(rope.get(k) == YARN_ROPE_SCALING[k] for k in YARN_KEYS):
        return theta, True
    wanted = ", ".join(f"{k}={YARN_ROPE_SCALING[k]}" for k in YARN_KEYS)
    raise WeightsError(f"rope type {rope_type!r} with {({k: rope.get(k) for k in YARN_KEYS})} has no MiniMindConfig "
                       f"equivalent; plain RoPE and MiniMind-3's YaRN ({wanted}) convert")


def yarn_rope_scaling(config):
    """The `rope_scaling` dict transformers' Qwen3 takes for the config's YaRN (rope_type yarn), or None."""
    scaling = rope_scaling_of(config)
    if scaling is None:
        return None
    return dict({k: scaling[k] for k in YARN_KEYS}, rope_type="yarn")


def read_hf_folder(folder):
    """(state_dict, config fields) of a Qwen3, Qwen3-MoE or MiniMind Hugging Face folder; WeightsError if unusable."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise WeightsError(f"{folder} has no config.json; pass a Hugging Face model folder or a .pth file")
    with open(config_path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type == "minimind":  # MiniMind's own folder: same names and fields as ours
        config = config_fields(raw)
        # MiniMind derives its rope_scaling from this flag (5.x writes it as rope_parameters): the flag decides
        config["rope_theta"] = _rope(raw)[0]
        config["inference_rope_scaling"] = bool(raw.get("inference_rope_scaling"))
        return clean_state_dict(_read_safetensors(folder), raw.get("tie_word_embeddings", True)), config
    if model_type in ("qwen3", "qwen3_moe"):
        from transformers import AutoConfig
        config, state_dict = hf_to_minimind(_read_safetensors(folder), AutoConfig.from_pretrained(folder))
        return state_dict, config_fields(config.to_dict())
    raise WeightsError(f"{config_path}: model_type {model_type!r} is not one of qwen3, qwen3_moe, minimind")


def _hf_moe_is_fused(hf_config):
    """True if this transformers' Qwen3-MoE stores experts as fused 3-D params (transformers >= 5)."""
    from transformers import Qwen3MoeForCausalLM
    with torch.device("meta"):
        keys = Qwen3MoeForCausalLM(hf_config).state_dict().keys()
    return "model.layers.0.mlp.experts.gate_up_proj" in keys


def minimind_to_hf(state_dict, config):
    """MiniMind (state_dict, MiniMindConfig) -> (Qwen3Config or Qwen3MoeConfig, HF state_dict)."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    state_dict = clean_state_dict(state_dict, config.tie_word_embeddings)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=yarn_rope_scaling(config),
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=getattr(config, "initializer_range", 0.02),
        attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, sliding_window=None,  # plain full causal attention in every layer
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    if not config.use_moe:
        return Qwen3Config(max_window_layers=config.num_hidden_layers, **common), dict(state_dict)

    if config.n_shared_experts > 0:
        raise WeightsError(f"n_shared_experts={config.n_shared_experts}: Qwen3-MoE has no shared experts",
                           fix=("minimind_format", None))
    if any(key.endswith(".mlp.expert_bias") for key in state_dict):
        raise WeightsError("a routing bias (trained with --router_balance bias or both): Qwen3-MoE routes without one",
                           fix=("minimind_format", None))
    hf_config = Qwen3MoeConfig(
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[], **common)
    if not _hf_moe_is_fused(hf_config):  # transformers 4.x: per-expert Linear names equal MiniMind's
        return hf_config, dict(state_dict)

    hf_sd = {k: v for k, v in state_dict.items() if ".mlp.experts." not in k}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        experts = range(config.num_experts)
        # fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
        hf_sd[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([state_dict[f"{p}.{e}.gate_proj.weight"], state_dict[f"{p}.{e}.up_proj.weight"]], dim=0)
            for e in experts])
        hf_sd[f"{p}.down_proj"] = torch.stack([state_dict[f"{p}.{e}.down_proj.weight"] for e in experts])
    return hf_config, hf_sd


def write_rope_both_ways(out_dir, rope_theta):
    """transformers 4.x reads `rope_theta` + `rope_scaling`, 5.x `rope_parameters`: write both so each major reads the
    same RoPE (the scaling save_pretrained wrote, YaRN included)."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("rope_theta", None)
    config["rope_theta"] = rope_theta
    config["rope_parameters"] = dict(rope, rope_type=rope_type, rope_theta=rope_theta)
    config["rope_scaling"] = dict(rope, rope_type=rope_type) if rope_type != "default" else None
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def write_num_experts_both_ways(out_dir, num_experts):
    """transformers 5.x writes `num_local_experts`, 4.x (and vLLM / SGLang running on it) reads `num_experts`: write
    both, or a 4.x reader builds Qwen3MoeConfig's default of 128 experts."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["num_experts"] = config["num_local_experts"] = num_experts
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_quietly(model, out_dir):
    """model.save_pretrained(out_dir) without transformers' "Writing model shards" bar, which it draws on every save."""
    from transformers.utils import logging as hf_logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def save_hf_folder(state_dict, config, out_dir, dtype):
    """A MiniMind state dict written as a Qwen3(-MoE) Hugging Face folder in `dtype` (scripts/convert_model.py's
    export, the RL stages' rollout servers); returns the Hugging Face model."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    hf_config, hf_sd = minimind_to_hf(state_dict, config)
    model = (Qwen3MoeForCausalLM if config.use_moe else Qwen3ForCausalLM)(hf_config)
    model.load_state_dict(hf_sd, strict=True)
    save_quietly(model.to(dtype), out_dir)
    write_rope_both_ways(out_dir, config.rope_theta)
    if config.use_moe:
        write_num_experts_both_ways(out_dir, config.num_experts)
    return model


def hf_to_minimind(hf_state_dict, hf_config):
    """HF Qwen3 / Qwen3-MoE (state_dict, config) -> (MiniMindConfig, MiniMind state_dict)."""
    if getattr(hf_config, "attention_bias", False):
        raise WeightsError("attention_bias=True has no MiniMind equivalent (all Linear layers are bias-free)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise WeightsError("sliding-window attention has no MiniMind equivalent; only full attention converts")
    heads = hf_config.num_attention_heads
    rope_theta, yarn = _rope(hf_config)
    kwargs = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=hf_config.num_key_value_heads or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        hidden_act=hf_config.hidden_act, max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta, inference_rope_scaling=yarn,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
    )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # keep MiniMind's defaults where HF has none
        if getattr(hf_config, name, None) is not None:
            kwargs[name] = getattr(hf_config, name)
    moe = hf_config.model_type == "qwen3_moe"
    if moe:
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
            raise WeightsError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                               "has no MiniMind equivalent: MiniMind MoE is MoE in every layer")
        kwargs.update(use_moe=True, num_experts=hf_config.num_experts,
                      num_experts_per_tok=hf_config.num_experts_per_tok,
                      moe_intermediate_size=hf_config.moe_intermediate_size, norm_topk_prob=hf_config.norm_topk_prob,
                      router_aux_loss_coef=hf_config.router_aux_loss_coef, n_shared_experts=0)
    elif hf_config.model_type != "qwen3":
        raise WeightsError(f"model_type {hf_config.model_type!r}: only qwen3 and qwen3_moe convert to MiniMind")
    config = MiniMindConfig(**kwargs)

    state_dict = clean_state_dict(hf_state_dict, config.tie_word_embeddings)
    out = {k: v for k, v in state_dict.items() if not (k.endswith("rotary_emb.inv_freq") or
                                                       k.endswith("mlp.experts.gate_up_proj") or
                                                       k.endswith("mlp.experts.down_proj"))}
    if moe:
        inter = config.moe_intermediate_size
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts"
            if f"{p}.gate_up_proj" not in state_dict:
                continue  # unfused (transformers 4.x) names already match MiniMind's
            gate_up, down = state_dict[f"{p}.gate_up_proj"], state_dict[f"{p}.down_proj"]
            for e in range(config.num_experts):
                out[f"{p}.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
                out[f"{p}.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
                out[f"{p}.{e}.down_proj.weight"] = down[e].clone()
    return config, out


def save_hf_classifier(state_dict, score_weight, config, out_dir, dtype):
    """A MiniMind trunk and a score head (1, hidden) written as transformers' sequence classifier (Qwen3's, or
    Qwen3-MoE's where this transformers has that class): what AutoModelForSequenceClassification loads as a reward
    model (trainer/stages/reward.py writes it). Returns the Hugging Face model."""
    from transformers import AutoModelForSequenceClassification
    hf_config, hf_sd = minimind_to_hf(state_dict, config)
    hf_config.num_labels = 1
    try:
        model = AutoModelForSequenceClassification.from_config(hf_config)
    except ValueError as e:  # transformers without a sequence classifier for this architecture
        raise WeightsError(f"this transformers has no sequence classifier for {type(hf_config).__name__} ({e})",
                           fix=("minimind_format", None)) from None
    hf_sd = {k: v for k, v in hf_sd.items() if not k.startswith("lm_head.")}
    model.load_state_dict(dict(hf_sd, **{"score.weight": score_weight}), strict=True)
    save_quietly(model.to(dtype), out_dir)
    write_rope_both_ways(out_dir, config.rope_theta)
    return model
