"""What a MiniMind state dict is: its names (clean_state_dict), the config fields its tensors fix (infer_config), and
whether it fits a model (shape_mismatch), in the model's own terms.

A WeightsError names what is wrong; where one setting would make the weights usable it carries that setting as `fix`
(a MiniMindConfig field and the weights' value of it, or a word below), which model/weights/flag_advice.py words as the
flag to pass: model/ knows no command line.
"""
import inspect

import torch

from model.model_minimind import MiniMindConfig

CONFIG_FIELDS = tuple(p for p in inspect.signature(MiniMindConfig.__init__).parameters if p not in ("self", "kwargs"))
VALUE_HEAD = "model.norm.value_head."  # PPO's critic on the trunk's final norm (trainer/rl/ppo.py), in its checkpoints
# fix words besides config fields: the tokenizer decides vocab_size; LoRA adapters given as a model; every model field;
# a MoE layout question; an export that needs MiniMind's own folder format
FIXES = ("tokenizer", "lora_adapters", "model_fields", "moe_layout", "minimind_format")


class WeightsError(ValueError):
    """A weight file that cannot be used: the message is one line saying what is wrong; `fix` = (setting, value) where
    one setting makes it usable (a MiniMindConfig field, or one of FIXES), else None."""

    def __init__(self, message, fix=None):
        super().__init__(message)
        self.fix = fix


def config_fields(config):
    """Keep only MiniMindConfig's own fields of a config dict (drops model_type, transformers_version, ...)."""
    return {k: v for k, v in config.items() if k in CONFIG_FIELDS}


def clean_state_dict(state_dict, tie=None):
    """Drop wrapper prefixes (DDP 'module.', torch.compile '_orig_mod.') and a PPO value head (not part of the language
    model); with tie, fill the missing tied twin."""
    out = {}
    for k, v in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            k = k[len(prefix):] if k.startswith(prefix) else k
        if not k.startswith(VALUE_HEAD):
            out[k] = v
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if tie and head not in out and embed in out:  # tied checkpoints may store one of the two names only
        out[head] = out[embed]
    if tie and embed not in out and head in out:
        out[embed] = out[head]
    return out


def _layer_ids(state_dict):
    return {int(k.split(".")[2]) for k in state_dict if k.startswith("model.layers.")}


def infer_config(state_dict):
    """MiniMindConfig fields implied by the tensors (what a .pth cannot say, like top-k or rope_theta, is left out)."""
    sd = clean_state_dict(state_dict)
    if sd and all(k.endswith((".lora.A.weight", ".lora.B.weight")) for k in sd):
        raise WeightsError("these are LoRA adapters (MiniMind's <module>.lora.A/B.weight), not a model's weights",
                           fix=("lora_adapters", None))
    try:
        vocab, hidden = sd["model.embed_tokens.weight"].shape
        head_dim = sd["model.layers.0.self_attn.q_norm.weight"].shape[0]
        layer0 = "model.layers.0."
        inferred = dict(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1 + max(_layer_ids(sd)), head_dim=head_dim,
            num_attention_heads=sd[layer0 + "self_attn.q_proj.weight"].shape[0] // head_dim,
            num_key_value_heads=sd[layer0 + "self_attn.k_proj.weight"].shape[0] // head_dim,
            tie_word_embeddings="lm_head.weight" not in sd or
                                torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]),
            use_moe=layer0 + "mlp.gate.weight" in sd,
        )
        if inferred["use_moe"]:
            shared = {k.split(".")[5] for k in sd if k.startswith(layer0 + "mlp.shared_experts.")}
            inferred.update(num_experts=sd[layer0 + "mlp.gate.weight"].shape[0], n_shared_experts=len(shared),
                            moe_intermediate_size=sd[layer0 + "mlp.experts.0.gate_proj.weight"].shape[0])
        else:
            inferred.update(intermediate_size=sd[layer0 + "mlp.gate_proj.weight"].shape[0])
    except (KeyError, ValueError) as e:
        raise WeightsError(f"these weights are not a MiniMind-3 / Qwen3 model (no tensor {e}); "
                           "weights without q_norm/k_norm (minimind2 and older) do not load") from None
    return inferred


def weight_fields(state_dict, saved_config=None):
    """MiniMindConfig fields the weights fix: their saved config, with what the tensors show on top."""
    fields = dict(saved_config or {})
    fields.update(infer_config(state_dict))
    return fields


# tensor-name fragment -> the config field a mismatch in that tensor points to, most specific first
_FIELD_RULES = (
    ("mlp.gate.weight", "num_experts"),
    ("mlp.experts.", "moe_intermediate_size"),
    ("mlp.shared_experts.", "moe_intermediate_size"),
    ("mlp.", "intermediate_size"),
    ("_norm.", "head_dim"),
    ("q_proj", "num_attention_heads"),
    ("o_proj", "num_attention_heads"),
    ("k_proj", "num_key_value_heads"),
    ("v_proj", "num_key_value_heads"),
)


def _fix_for(name, file_shape, inferred, config):
    """(setting, value) that makes tensor `name` fit; hidden size and head_dim are checked first."""
    if inferred["hidden_size"] != config.hidden_size:
        return "hidden_size", inferred["hidden_size"]
    if inferred["head_dim"] != config.head_dim and "self_attn" in name:
        return "head_dim", inferred["head_dim"]
    if "embed_tokens" in name or "lm_head" in name:
        return "tokenizer", file_shape[0]
    for fragment, field in _FIELD_RULES:
        if fragment in name and field in inferred:
            return field, inferred[field]
    return "model_fields", None


def shape_mismatch(state_dict, model, path):
    """None if `state_dict` loads strict into `model`, else a WeightsError (not raised) naming the file, tensor and
    shapes, with the setting that fixes it."""
    config = model.config
    try:
        inferred = infer_config(state_dict)
    except WeightsError as e:
        return WeightsError(f"{path}: {e}", e.fix)
    sd = clean_state_dict(state_dict, config.tie_word_embeddings or inferred["tie_word_embeddings"])
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.use_moe:  # a routing bias (--router_balance bias/both) loads into any MoE layer: it makes the buffer
        expected.update({k: (config.num_experts,) for k in sd if k.endswith(".mlp.expert_bias")})
    if inferred["use_moe"] != bool(config.use_moe):
        name = "model.layers.0.mlp.gate.weight" if inferred["use_moe"] else "model.layers.0.mlp.gate_proj.weight"
        kind = "MoE" if inferred["use_moe"] else "dense"
        return WeightsError(f"{path}: {name} shows a {kind} model", ("use_moe", int(inferred["use_moe"])))
    if inferred["num_hidden_layers"] != config.num_hidden_layers:
        return WeightsError(f"{path}: the weights have {inferred['num_hidden_layers']} layers (model.layers.0-"
                            f"{inferred['num_hidden_layers'] - 1}), the model {config.num_hidden_layers}",
                            ("num_hidden_layers", inferred["num_hidden_layers"]))
    if not inferred["tie_word_embeddings"] and config.tie_word_embeddings:
        return WeightsError(f"{path}: lm_head.weight differs from model.embed_tokens.weight (untied)",
                            ("tie_word_embeddings", 0))
    for name, shape in expected.items():
        if name not in sd:
            return WeightsError(f"{path}: tensor {name} is missing; these are not weights of this model architecture")
        file_shape = tuple(sd[name].shape)
        if file_shape != shape:
            return WeightsError(f"{path}: tensor {name} has shape {list(file_shape)} in the file but {list(shape)} in "
                                "the model", _fix_for(name, file_shape, inferred, config))
    extra = sorted(set(sd) - set(expected))
    if extra:
        return WeightsError(f"{path}: tensor {extra[0]} has no place in this model ({len(extra)} unexpected)",
                            ("moe_layout", None))
    return None


def load_checked(model, state_dict, path):
    """Check `state_dict` (read from `path`) against `model` and load it strict (fp32 copy); raises the mismatch."""
    mismatch = shape_mismatch(state_dict, model, path)
    if mismatch:
        raise mismatch
    sd = clean_state_dict(state_dict, True)  # shape_mismatch checked that a stored lm_head equals the embedding
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model
