"""MiniMind's weights file, `<stem>.pth` + its sidecar config `<stem>.json`: the one writer (save_weights_file) and
reader (read_weights, read_sidecar, read_record), which also reads the other weights a user may name.

read_weights takes a MiniMind `.pth` state dict (ours, with its sidecar, or MiniMind-3's bare one), a torch file whose
"model" entry is the state dict (MiniMind's `*_resume.pth`, read as weights; trainer/ckpt/minimind_resume.py reads it
as a resume) and a Hugging Face folder (model/hf_convert.py). The trainer's checkpoint directories (`step_<N>/`) are
read by trainer/ckpt/resume.py, their owner. Shapes and names: model/weights/shapes.py; atomic writes:
model/atomic.py.
"""
import json
import os
import pickle

import numpy as np
import torch

from model.atomic import atomic_json, atomic_save
from model.provenance import tokenizer_record, tokenizer_sha256
from model.weights.shapes import CONFIG_FIELDS, WeightsError, clean_state_dict, config_fields, load_checked

CHECKPOINT_MARK = ".metadata"  # what a DCP step directory holds (trainer/ckpt/resume.py reads those)


def sidecar_path(path):
    """The config file beside a weights file: out/pretrain_768.pth -> out/pretrain_768.json."""
    return os.path.splitext(path)[0] + ".json"


def save_weights_file(state_dict, config, path, record=None):
    """MiniMind's plain state dict at `path` and its sidecar beside it, both atomic: the model's MiniMindConfig fields
    plus `record` (what the run used: "tokenizer" {"path", "sha256"}, "step", a LoRA stage's "lora")."""
    fields = {k: v for k, v in config_fields(config.to_dict()).items() if k != "loss_chunk_size"}  # a training knob
    fields.update(record or {}, model_type="minimind")
    atomic_save(state_dict, path)
    atomic_json(fields, sidecar_path(path))


def is_checkpoint_dir(path):
    """Whether `path` is a DCP directory (the trainer's step_<N>), which trainer/ckpt/resume.py reads."""
    return os.path.isfile(os.path.join(path, CHECKPOINT_MARK))


def read_weights(path):
    """(state_dict, config_dict or None) from a .pth, a single-file resume or an HF folder; WeightsError if unusable."""
    state_dict, config, _ = read_weights_and_args(path)
    return state_dict, config


def read_weights_and_args(path):
    """read_weights plus the saved training args of a single-file resume (None for the others)."""
    if is_checkpoint_dir(path):
        raise WeightsError(f"{path} is a training checkpoint directory; read it with trainer/ckpt/resume.py "
                           "(read_any_weights)")
    if os.path.isdir(path):
        from model.hf_convert import read_hf_folder  # transformers' folders: read by the runs given one only
        state_dict, config = read_hf_folder(path)
        return state_dict, config, None
    if not os.path.isfile(path):
        raise WeightsError(f"{path} does not exist; pass a .pth file, a resume checkpoint or a Hugging Face folder")
    obj = load_torch_file(path)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):  # single-file resume (MiniMind's: no config)
        config = obj.get("config")
        return clean_state_dict(obj["model"]), config_fields(config) if config else None, obj.get("args")
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise WeightsError(f"{path} holds no state dict (a {type(obj).__name__}); pass MiniMind weights")
    return clean_state_dict(obj), read_sidecar(path), None


def load_torch_file(path):
    """torch.load(weights_only) of a weights or resume file, numpy RNG state allowed; WeightsError in one line."""
    try:
        with torch.serialization.safe_globals(numpy_rng_globals()):  # older resume files hold numpy RNG state
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = "weights_only" in str(e)  # a real pickle with other objects, not garbage
        raise WeightsError(f"{path} is not a torch weight file" + (
            " (it holds objects other than tensors and RNG state, which are not unpickled)" if refused else "") +
            "; pass a .pth, a resume checkpoint or an HF folder") from None
    except Exception as e:
        raise WeightsError(f"{path} is not a torch weight file ({type(e).__name__}); pass a .pth or an HF folder")


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

    A .pth: its sidecar; an HF folder: its own tokenizer files; MiniMind's bare .pth or resume file: nothing (a
    checkpoint directory: trainer/ckpt/resume.read_checkpoint_record)."""
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


def numpy_rng_globals():
    """What np.random.get_state() pickles to, allowed on top of torch's weights_only set (nothing executable)."""
    try:  # numpy 2 renamed numpy.core (numpy 1.26 has a numpy._core stub without multiarray)
        from numpy._core.multiarray import _reconstruct
    except (ImportError, AttributeError):
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_weights(model, path):
    """Read `path`, check it against `model` and load it strict (fp32 copy); WeightsError(one line) on mismatch."""
    state_dict, _ = read_weights(path)
    return load_checked(model, state_dict, path)
