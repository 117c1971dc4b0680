"""Convert MiniMind weights to / from Hugging Face Qwen3 (dense) and Qwen3-MoE.

    python scripts/convert_model.py --weight out/pretrain_768.pth --out_dir out/hf_model
    python scripts/convert_model.py --to minimind --out_dir out/hf_model --weight out/from_hf_768.pth

The Hugging Face folder loads with AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained.
Relative paths resolve against the repository root, not the current directory.
"""
import argparse
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model.model_minimind import MiniMindConfig  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _rope_theta(hf_config):
    """rope_theta of a Qwen3 config (transformers 5 keeps it in rope_parameters, 4.x as an attribute)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} / rope_scaling has no MiniMind equivalent; only plain RoPE converts")
    return rope.get("rope_theta", getattr(hf_config, "rope_theta", None))


def _hf_moe_is_fused(hf_config):
    """True if this transformers' Qwen3-MoE stores experts as fused 3-D params (transformers >= 5)."""
    from transformers import Qwen3MoeForCausalLM
    with torch.device("meta"):
        keys = Qwen3MoeForCausalLM(hf_config).state_dict().keys()
    return "model.layers.0.mlp.experts.gate_up_proj" in keys


def _clean_state_dict(state_dict, tie):
    """Drop wrapper prefixes (DDP 'module.', torch.compile '_orig_mod.') and fill a missing tied lm_head."""
    out = {}
    for k, v in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            k = k[len(prefix):] if k.startswith(prefix) else k
        out[k] = v
    if tie and "lm_head.weight" not in out:  # tied checkpoints may store the embedding only
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def minimind_to_hf(state_dict, config):
    """MiniMind (state_dict, MiniMindConfig) -> (Qwen3Config or Qwen3MoeConfig, HF state_dict)."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    state_dict = _clean_state_dict(state_dict, config.tie_word_embeddings)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=getattr(config, "initializer_range", 0.02),
        attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, sliding_window=None,  # plain full causal attention in every layer
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    if not config.use_moe:
        return Qwen3Config(max_window_layers=config.num_hidden_layers, **common), dict(state_dict)

    if config.n_shared_experts > 0:
        raise ValueError(f"n_shared_experts={config.n_shared_experts}: Qwen3-MoE has no shared experts, "
                         "only MoE models with n_shared_experts=0 convert")
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


def hf_to_minimind(hf_state_dict, hf_config):
    """HF Qwen3 / Qwen3-MoE (state_dict, config) -> (MiniMindConfig, MiniMind state_dict)."""
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias=True has no MiniMind equivalent (all Linear layers are bias-free)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("sliding-window attention has no MiniMind equivalent; only full attention converts")
    heads = hf_config.num_attention_heads
    kwargs = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=hf_config.num_key_value_heads or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        hidden_act=hf_config.hidden_act, max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps, rope_theta=_rope_theta(hf_config),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
    )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # keep MiniMind's defaults where HF has none
        if getattr(hf_config, name, None) is not None:
            kwargs[name] = getattr(hf_config, name)
    moe = hf_config.model_type == "qwen3_moe"
    if moe:
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
            raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                             "has no MiniMind equivalent: MiniMind MoE is MoE in every layer")
        kwargs.update(use_moe=True, num_experts=hf_config.num_experts,
                      num_experts_per_tok=hf_config.num_experts_per_tok,
                      moe_intermediate_size=hf_config.moe_intermediate_size, norm_topk_prob=hf_config.norm_topk_prob,
                      router_aux_loss_coef=hf_config.router_aux_loss_coef, n_shared_experts=0)
    elif hf_config.model_type != "qwen3":
        raise ValueError(f"model_type {hf_config.model_type!r}: only qwen3 and qwen3_moe convert to MiniMind")
    config = MiniMindConfig(**kwargs)

    state_dict = _clean_state_dict(hf_state_dict, config.tie_word_embeddings)
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


def config_from_state_dict(state_dict, num_experts_per_tok=1, **overrides):
    """Infer a MiniMindConfig from weight shapes; `overrides` (MiniMind flags) must agree with what is inferred."""
    sd = _clean_state_dict(state_dict, tie=False)
    vocab, hidden = sd["model.embed_tokens.weight"].shape
    head_dim = sd["model.layers.0.self_attn.q_norm.weight"].shape[0]
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
    use_moe = "model.layers.0.mlp.gate.weight" in sd
    inferred = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
        num_attention_heads=sd["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        tie_word_embeddings="lm_head.weight" not in sd or
                            torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]),
        use_moe=use_moe,
    )
    if use_moe:
        num_experts = sd["model.layers.0.mlp.gate.weight"].shape[0]
        shared = {k.split(".")[5] for k in sd if k.startswith("model.layers.0.mlp.shared_experts.")}
        inferred.update(num_experts=num_experts, n_shared_experts=len(shared),
                        moe_intermediate_size=sd["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0],
                        num_experts_per_tok=num_experts_per_tok)
    else:
        inferred.update(intermediate_size=sd["model.layers.0.mlp.gate_proj.weight"].shape[0])
    for name, value in overrides.items():
        if value is not None and name in inferred and inferred[name] != value:
            raise ValueError(f"--{name} {value} does not match the weights ({inferred[name]}); drop the flag or fix it")
    return MiniMindConfig(**inferred)


def _resolve(path):
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def _load_weights(path):
    """A plain state dict, or the 'model' entry of a resume checkpoint."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["model"] if isinstance(obj, dict) and isinstance(obj.get("model"), dict) else obj


def to_hf(args):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    state_dict = _load_weights(_resolve(args.weight))
    config = config_from_state_dict(
        state_dict, num_experts_per_tok=args.num_experts_per_tok, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, use_moe=None if args.use_moe is None else bool(args.use_moe),
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        num_experts=args.num_experts)
    if args.rope_theta is not None:
        config.rope_theta = args.rope_theta
    hf_config, hf_sd = minimind_to_hf(state_dict, config)
    dtype = hf_sd["model.embed_tokens.weight"].dtype
    model_cls = Qwen3MoeForCausalLM if config.use_moe else Qwen3ForCausalLM
    model = model_cls(hf_config)
    model.load_state_dict(hf_sd, strict=True)
    out_dir = _resolve(args.out_dir)
    model.to(dtype).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        src = os.path.join(ROOT, "model", name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))
    print(f"wrote {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) to {out_dir}")


def to_minimind(args):
    from transformers import AutoModelForCausalLM
    hf_dir = _resolve(args.out_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir)
    config, state_dict = hf_to_minimind(hf_model.state_dict(), hf_model.config)
    weight = _resolve(args.weight)
    os.makedirs(os.path.dirname(weight) or ".", exist_ok=True)
    torch.save({k: v.contiguous() for k, v in state_dict.items()}, weight)
    flags = (f"--hidden_size {config.hidden_size} --num_hidden_layers {config.num_hidden_layers} "
             f"--use_moe {int(config.use_moe)}")
    print(f"wrote MiniMind weights to {weight} (load with {flags}; full config: {config.to_json_string()})")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Convert MiniMind .pth <-> Hugging Face Qwen3 folder")
    parser.add_argument("--to", choices=["hf", "minimind"], default="hf", help="direction of conversion")
    parser.add_argument("--weight", default="out/pretrain_768.pth",
                        help="MiniMind .pth (input for --to hf, output for --to minimind)")
    parser.add_argument("--out_dir", "--hf_dir", dest="out_dir", default="out/hf_model",
                        help="Hugging Face folder (output for --to hf, input for --to minimind)")
    # MiniMind flags: shapes are read from the weights, flags given must agree with them
    parser.add_argument("--hidden_size", type=int, default=None)
    parser.add_argument("--num_hidden_layers", type=int, default=None)
    parser.add_argument("--use_moe", type=int, default=None, choices=[0, 1])
    parser.add_argument("--num_attention_heads", type=int, default=None)
    parser.add_argument("--num_key_value_heads", type=int, default=None)
    parser.add_argument("--num_experts", type=int, default=None)
    parser.add_argument("--num_experts_per_tok", type=int, default=1, help="top-k (not visible in the weights)")
    parser.add_argument("--rope_theta", type=float, default=None, help="default: MiniMindConfig's")
    args = parser.parse_args(argv)
    to_hf(args) if args.to == "hf" else to_minimind(args)


if __name__ == "__main__":
    main()
