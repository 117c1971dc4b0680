"""Read MiniMind weights from any file we meet and check them against a model, without tracebacks.

Formats: a MiniMind `.pth` state dict (ours, with its sidecar config `<stem>.json`, or MiniMind-3's bare one), a resume
checkpoint (the trainer's DCP directory `step_<N>/`, or a single file holding "model": MiniMind's `*_resume.pth`), and a
Hugging Face folder (Qwen3, Qwen3-MoE, or MiniMind's own `model_type: minimind`).
Writing: save_weights_file, the .pth plus its sidecar (model fields, and what the run used: tokenizer, step), each
atomically (atomic_save); read_record reads back what a file records besides the model.
Also the weight mapping MiniMind <-> transformers Qwen3 / Qwen3-MoE used by scripts/convert_model.py.
"""
import inspect
import json
import os
import pickle
import shutil
from contextlib import contextmanager

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from model.model_minimind import MiniMindConfig
from model.provenance import tokenizer_record, tokenizer_sha256

CONFIG_FIELDS = tuple(p for p in inspect.signature(MiniMindConfig.__init__).parameters if p not in ("self", "kwargs"))


class WeightsError(ValueError):
    """A weight file that cannot be used: the message is one line saying what to change."""


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def _atomic_write(path, write):
    """write(file) into a temporary file, fsync, then rename: a killed save never leaves a valid-looking file, and a
    failed one (a full disk) leaves neither the temporary file nor a changed `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def atomic_folder(path):
    """Yield a temporary folder beside `path` to write into; when the block ends it takes the place of `path`, and a
    block that fails (a full disk) leaves neither the temporary folder nor a changed `path`."""
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(path):
            os.rename(old, path)  # the rename in between failed: the previous folder comes back
        raise
    shutil.rmtree(old, ignore_errors=True)


def atomic_save(obj, path):
    """torch.save `obj` to `path` atomically (temporary file, fsync, rename)."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path, text):
    """Write `text` (UTF-8) to `path` atomically: an index or config file is either the old one or the new one."""
    _atomic_write(path, lambda f: f.write(text.encode()))


def sidecar_path(path):
    """The config file beside a weights file: out/pretrain_768.pth -> out/pretrain_768.json."""
    return os.path.splitext(path)[0] + ".json"


def atomic_json(obj, path):
    """`obj` as indented JSON at `path`, atomically."""
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True).encode()))


def save_weights_file(state_dict, config, path, record=None):
    """MiniMind's plain state dict at `path` and its sidecar beside it, both atomic: the model's MiniMindConfig fields
    plus `record` (what the run used: "tokenizer" {"path", "sha256"}, "step", a LoRA stage's "lora")."""
    fields = {k: v for k, v in config_fields(config.to_dict()).items() if k != "loss_chunk_size"}  # a training knob
    fields.update(record or {}, model_type="minimind")
    atomic_save(state_dict, path)
    atomic_json(fields, sidecar_path(path))


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def read_weights(path):
    """(state_dict, config_dict or None) from a .pth, a resume checkpoint or an HF folder; WeightsError if unusable."""
    state_dict, config, _ = read_checkpoint(path)
    return state_dict, config


def read_checkpoint(path):
    """(state_dict, config_dict or None, saved training args or None): read_weights plus the run's args."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return _read_dcp_checkpoint(path)
    if os.path.isdir(path):
        state_dict, config = _read_hf_folder(path)
        return state_dict, config, None
    if not os.path.isfile(path):
        raise WeightsError(f"{path} does not exist; pass a .pth file, a resume checkpoint or a Hugging Face folder")
    try:
        with torch.serialization.safe_globals(numpy_rng_globals()):  # older resume files hold numpy RNG state
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = "weights_only" in str(e)  # a real pickle with other objects, not garbage
        raise WeightsError(f"{path} is not a torch weight file" + (
            " (it holds objects other than tensors and RNG state, which are not unpickled)" if refused else "") +
            "; pass a .pth, a resume checkpoint or an HF folder") from None
    except Exception as e:
        raise WeightsError(f"{path} is not a torch weight file ({type(e).__name__}); pass a .pth or an HF folder")
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):  # single-file resume (MiniMind's: no config)
        config = obj.get("config")
        return clean_state_dict(obj["model"]), config_fields(config) if config else None, obj.get("args")
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise WeightsError(f"{path} holds no state dict (a {type(obj).__name__}); pass MiniMind weights")
    return clean_state_dict(obj), read_sidecar(path), None


def read_sidecar(path):
    """The config fields saved beside a .pth, or None when it has no sidecar (MiniMind-3's own weights)."""
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return None
    try:
        with open(side) as f:
            config = json.load(f)
        return config_fields(config)
    except (ValueError, AttributeError) as e:
        raise WeightsError(f"{side} (the config of {os.path.basename(path)}) is not a JSON object "
                           f"({type(e).__name__}); delete it to infer the shapes from the tensors") from None


def read_record(path):
    """What weights record besides the model: {"tokenizer": {"path", "sha256"}, "step": N, ...}, as far as known.

    A .pth: its sidecar; a resume directory: its train_state (older ones: the typed --tokenizer_path only); an HF
    folder: its own tokenizer files; MiniMind's bare .pth or resume file: nothing."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        try:
            saved = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
        except Exception:
            return {}  # read_checkpoint names the unreadable file
        tokenizer = saved.get("tokenizer") or {"path": (saved.get("args") or {}).get("tokenizer_path"), "sha256": None}
        return {"tokenizer": tokenizer if tokenizer["path"] else None,
                "step": (saved.get("train_state") or {}).get("global_step")}
    if os.path.isdir(path):
        return {"tokenizer": tokenizer_record(path)} if tokenizer_sha256(path) else {}
    side = sidecar_path(path)
    if not path.endswith(".pth") or not os.path.isfile(side):
        return {}
    try:
        with open(side) as f:
            return {k: v for k, v in json.load(f).items() if k not in CONFIG_FIELDS and k != "model_type"}
    except (ValueError, AttributeError):
        return {}  # read_sidecar names the broken file


def _read_dcp_checkpoint(path):
    """(state_dict, config_dict, args) of the trainer's resume directory: its model entries, whatever layout saved
    it."""
    try:
        state = {}  # the planner fills it with full tensors from every rank's files (as dcp_to_torch_save does)
        _load_state_dict(state, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}),
                         no_dist=True)
        saved = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"{path} is not a readable resume checkpoint ({type(e).__name__}); pass a complete "
                           "step_<N> directory, a .pth or an HF folder") from None
    return clean_state_dict(state["model"]), config_fields(saved["config"]), saved.get("args")


def numpy_rng_globals():
    """What np.random.get_state() pickles to, allowed on top of torch's weights_only set (nothing executable)."""
    try:  # numpy 2 renamed numpy.core (numpy 1.26 has a numpy._core stub without multiarray)
        from numpy._core.multiarray import _reconstruct
    except (ImportError, AttributeError):
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def config_fields(config):
    """Keep only MiniMindConfig's own fields of a config dict (drops model_type, transformers_version, ...)."""
    return {k: v for k, v in config.items() if k in CONFIG_FIELDS}


VALUE_HEAD = "model.norm.value_head."  # PPO's critic on the trunk's final norm (trainer/ppo.py), in its checkpoints


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


def _rope_theta(config):
    """rope_theta from a config dict or object: 4.x writes `rope_theta`, 5.x `rope_parameters`; refuse scaled RoPE."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise WeightsError(f"rope type {rope_type!r} (rope_scaling / inference_rope_scaling) has no MiniMindConfig "
                           "equivalent; only plain RoPE converts")
    theta = rope.get("rope_theta", get("rope_theta"))
    return 1e6 if theta is None else float(theta)


def _read_hf_folder(folder):
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise WeightsError(f"{folder} has no config.json; pass a Hugging Face model folder or a .pth file")
    with open(config_path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type == "minimind":  # MiniMind's own folder: same names and fields as ours
        if raw.get("inference_rope_scaling"):
            raise WeightsError(f"{config_path}: inference_rope_scaling (YaRN) has no equivalent here; set it false")
        config = config_fields(raw)
        config["rope_theta"] = _rope_theta(raw)
        return clean_state_dict(_read_safetensors(folder), raw.get("tie_word_embeddings", True)), config
    if model_type in ("qwen3", "qwen3_moe"):
        from transformers import AutoConfig
        config, state_dict = hf_to_minimind(_read_safetensors(folder), AutoConfig.from_pretrained(folder))
        return state_dict, config_fields(config.to_dict())
    raise WeightsError(f"{config_path}: model_type {model_type!r} is not one of qwen3, qwen3_moe, minimind")


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------
def _layer_ids(state_dict):
    return {int(k.split(".")[2]) for k in state_dict if k.startswith("model.layers.")}


def infer_config(state_dict):
    """MiniMindConfig fields implied by the tensors (what a .pth cannot say, like top-k or rope_theta, is left out)."""
    sd = clean_state_dict(state_dict)
    if sd and all(k.endswith((".lora.A.weight", ".lora.B.weight")) for k in sd):
        raise WeightsError("these are LoRA adapters (MiniMind's <module>.lora.A/B.weight), not a model's weights; pass "
                           "the base model here and the adapters to --lora (eval_llm.py, convert_model.py)")
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


def flag_conflicts(fields, flags):
    """One '--name value (the weights have w)' per given flag (not None) that disagrees with the weights' fields."""
    return [f"--{name} {value} (the weights have {fields[name]})" for name, value in flags.items()
            if value is not None and name in fields and fields[name] != value]


# tensor-name fragment -> (config field, flag) a mismatch in that tensor points to, most specific first
_FLAG_RULES = (
    ("mlp.gate.weight", "num_experts", "--num_experts"),
    ("mlp.experts.", "moe_intermediate_size", "--moe_intermediate_size"),
    ("mlp.shared_experts.", "moe_intermediate_size", "--moe_intermediate_size"),
    ("mlp.", "intermediate_size", "--intermediate_size"),
    ("_norm.", "head_dim", "--head_dim"),
    ("q_proj", "num_attention_heads", "--num_attention_heads"),
    ("o_proj", "num_attention_heads", "--num_attention_heads"),
    ("k_proj", "num_key_value_heads", "--num_key_value_heads"),
    ("v_proj", "num_key_value_heads", "--num_key_value_heads"),
)


def _flag_for(name, file_shape, inferred, config):
    """The flag (with the weights' value) that makes `name` fit; hidden size and head_dim are checked first."""
    if inferred["hidden_size"] != config.hidden_size:
        return f"--hidden_size {inferred['hidden_size']}"
    if inferred["head_dim"] != config.head_dim and "self_attn" in name:
        return f"--head_dim {inferred['head_dim']}"
    if "embed_tokens" in name or "lm_head" in name:
        return f"the tokenizer these weights were trained with (vocab_size {file_shape[0]}): --tokenizer_path"
    for fragment, field, flag in _FLAG_RULES:
        if fragment in name and field in inferred:
            return f"{flag} {inferred[field]}"
    return "the model flags these weights were trained with"


def shape_mismatch(state_dict, model, path):
    """None if `state_dict` loads strict into `model`, else ONE line naming the file, tensor, shapes and the flag."""
    config = model.config
    try:
        inferred = infer_config(state_dict)
    except WeightsError as e:
        return f"{path}: {e}"
    sd = clean_state_dict(state_dict, config.tie_word_embeddings or inferred["tie_word_embeddings"])
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if inferred["use_moe"] != bool(config.use_moe):
        name = "model.layers.0.mlp.gate.weight" if inferred["use_moe"] else "model.layers.0.mlp.gate_proj.weight"
        kind = "MoE" if inferred["use_moe"] else "dense"
        return f"{path}: {name} shows a {kind} model; pass --use_moe {int(inferred['use_moe'])}"
    if inferred["num_hidden_layers"] != config.num_hidden_layers:
        return (f"{path}: the weights have {inferred['num_hidden_layers']} layers (model.layers.0-"
                f"{inferred['num_hidden_layers'] - 1}), the model {config.num_hidden_layers}; "
                f"pass --num_hidden_layers {inferred['num_hidden_layers']}")
    if not inferred["tie_word_embeddings"] and config.tie_word_embeddings:
        return f"{path}: lm_head.weight differs from model.embed_tokens.weight (untied); pass --tie_word_embeddings 0"
    for name, shape in expected.items():
        if name not in sd:
            return f"{path}: tensor {name} is missing; these are not weights of this model architecture"
        file_shape = tuple(sd[name].shape)
        if file_shape != shape:
            flag = _flag_for(name, file_shape, inferred, config)
            return (f"{path}: tensor {name} has shape {list(file_shape)} in the file but {list(shape)} in the model; "
                    f"pass {flag}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        return (f"{path}: tensor {extra[0]} has no place in this model ({len(extra)} unexpected); "
                "check --use_moe / shared experts")
    return None


def load_weights(model, path):
    """Read `path`, check it against `model` and load it strict (fp32 copy); WeightsError(one line) on mismatch."""
    state_dict, _ = read_weights(path)
    message = shape_mismatch(state_dict, model, path)
    if message:
        raise WeightsError(message)
    sd = clean_state_dict(state_dict, True)  # shape_mismatch checked that a stored lm_head equals the embedding
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model


# ----------------------------------------------------------------------------------------------
# MiniMind <-> transformers Qwen3 / Qwen3-MoE
# ----------------------------------------------------------------------------------------------
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
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=getattr(config, "initializer_range", 0.02),
        attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, sliding_window=None,  # plain full causal attention in every layer
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    if not config.use_moe:
        return Qwen3Config(max_window_layers=config.num_hidden_layers, **common), dict(state_dict)

    if config.n_shared_experts > 0:
        raise WeightsError(f"n_shared_experts={config.n_shared_experts}: Qwen3-MoE has no shared experts; "
                           "export with --format minimind instead")
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
    """transformers 4.x reads `rope_theta`, 5.x `rope_parameters`: write both so each major reads the same value."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_theta"] = rope_theta
    config["rope_parameters"] = dict(config.get("rope_parameters") or {}, rope_type="default", rope_theta=rope_theta)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_hf_folder(state_dict, config, out_dir, dtype):
    """A MiniMind state dict written as a Qwen3(-MoE) Hugging Face folder in `dtype` (scripts/convert_model.py's
    export, the RL stages' rollout servers); returns the Hugging Face model."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    hf_config, hf_sd = minimind_to_hf(state_dict, config)
    model = (Qwen3MoeForCausalLM if config.use_moe else Qwen3ForCausalLM)(hf_config)
    model.load_state_dict(hf_sd, strict=True)
    model.to(dtype).save_pretrained(out_dir)
    write_rope_both_ways(out_dir, config.rope_theta)
    return model


def hf_to_minimind(hf_state_dict, hf_config):
    """HF Qwen3 / Qwen3-MoE (state_dict, config) -> (MiniMindConfig, MiniMind state_dict)."""
    if getattr(hf_config, "attention_bias", False):
        raise WeightsError("attention_bias=True has no MiniMind equivalent (all Linear layers are bias-free)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise WeightsError("sliding-window attention has no MiniMind equivalent; only full attention converts")
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
