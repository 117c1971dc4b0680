"""Load a chat model: weights (--weight prefix or .pth, --checkpoint, --load_from HF folder) + LoRA + tokenizer from the
loading flags (scripts/inference/flags.py), each refusal one line naming the flag (LOAD_ERRORS)."""
import json
import math
import os
import re
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from model.errors import ConfigError, check_device
from model.lora import LoraError, apply_lora_file
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.tokenizer_choice import TokenizerMismatch, check_tokenizer, tokenizer_for, vocab_refusal
from model.weights.files import is_checkpoint_dir, load_weights, read_record, read_weights, read_weights_and_args
from model.weights.flag_advice import weights_line
from model.weights.paths import file_digest, other_sizes, typed_or_default, weight_path
from model.weights.shapes import WeightsError, load_checked, weight_fields


def read_any(path):
    """(state_dict, config fields or None, saved training args or None) of the weights at `path`; WeightsError in one
    line."""
    if not is_checkpoint_dir(path):
        return read_weights_and_args(path)
    # the trainer's format, read by its owner (trainer/ckpt/resume.py), loaded only when --checkpoint names one
    from trainer.ckpt.resume import read_checkpoint_model
    return read_checkpoint_model(path)


def any_record(path):
    """What the weights at `path` record besides the model ({"tokenizer", "step", ...}, as far as known)."""
    if not is_checkpoint_dir(path):
        return read_record(path)
    from trainer.ckpt.resume import read_checkpoint_record  # as read_any: only a resume checkpoint needs it
    return read_checkpoint_record(path)


def load_any(model, path):
    """Read `path`, check it against `model` and load it strict; WeightsError (with its fix) if it does not fit."""
    return load_checked(model, read_any(path)[0], path)


def load_folder(folder):
    """A Hugging Face folder: MiniMind-format ones through our model (no remote code runs), others via transformers."""
    with open(os.path.join(folder, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type == "minimind":
        _, fields = read_weights(folder)
        return load_weights(MiniMindForCausalLM(MiniMindConfig(**fields)), folder)
    return AutoModelForCausalLM.from_pretrained(folder).float()


def tokenizer_folder(args, weights=None):
    """The tokenizer for `weights` (None: before loading, the folder that must exist): --tokenizer_path, else the one
    the weights record (a .pth's sidecar, a checkpoint, an exported folder's own files), else model/. A
    --tokenizer_path other than the recorded tokenizer is refused (TokenizerMismatch) unless --force_tokenizer 1."""
    typed = typed_or_default(args.tokenizer_path, None)
    record = any_record(weights).get("tokenizer") if weights else None
    if weights is None or (args.load_from and record is None):
        return typed or args.load_from or typed_or_default(None, "model")
    flag = "--load_from" if args.load_from else "--checkpoint" if args.checkpoint else "--weight"
    folder, note = tokenizer_for(record, typed, typed_or_default(None, "model"), f"{flag} {weights}",
                                 bool(args.force_tokenizer))
    if note:
        print(f"note: {note}", file=sys.stderr)
    return folder


def load_model(args):
    """(model, where its weights are): --load_from folder, --checkpoint (a resume checkpoint, config included) or
    out/<weight>_<hidden>[_moe].pth (its config from <weight>_<hidden>[_moe].json beside it; the model flags fill in
    for a .pth without one)."""
    if args.load_from:
        return load_folder(args.load_from), args.load_from
    if args.checkpoint:
        path = os.path.abspath(args.checkpoint)
        _, fields, _ = read_any(path)
        if fields is None:
            raise WeightsError(f"{path} is not a resume checkpoint (no config); pass it with --weight instead")
    else:
        flags = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                     num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                     use_moe=bool(args.use_moe), num_experts=args.num_experts,
                     num_experts_per_tok=args.num_experts_per_tok)
        path = os.path.abspath(prefix_weights(args, flags))
        state_dict, saved_config = read_weights(path)  # the trainer's .pth has its config beside it (<stem>.json)
        fields = {k: v for k, v in flags.items() if v is not None}
        fields.update(weight_fields(state_dict, saved_config))  # flags only fill in what a bare .pth lacks
    return load_any(MiniMindForCausalLM(MiniMindConfig(**fields)), path), path


def prefix_weights(args, flags):
    """The .pth --weight names: a path as typed; a prefix with --hidden_size, <save_dir>/<prefix>_<hidden>[_moe].pth;
    a prefix alone, the one file of that prefix in <save_dir> (its sidecar holds the size), else an error naming
    them."""
    save_dir = typed_or_default(args.save_dir, "out")
    if args.hidden_size is not None or args.weight.endswith(".pth"):
        path = weight_path(args.weight, save_dir, MiniMindConfig(**dict(flags, hidden_size=args.hidden_size or 768)))
        if not os.path.isfile(path):
            raise WeightsError(f"{path} does not exist; {other_sizes(path, '--weight')}train it first or pass "
                               "--weight/--hidden_size/--load_from")
        return path
    suffix = "_moe" if args.use_moe else ""
    pattern = re.escape(args.weight) + r"_\d+" + suffix + r"\.pth"
    found = sorted(n for n in os.listdir(save_dir) if re.fullmatch(pattern, n)) if os.path.isdir(save_dir) else []
    if len(found) == 1:
        return os.path.join(save_dir, found[0])
    wanted = os.path.join(save_dir, f"{args.weight}_<hidden_size>{suffix}.pth")
    if not found:
        raise WeightsError(f"{wanted} does not exist (no file of that name in {save_dir}); train it first or pass "
                           "--weight/--hidden_size/--load_from")
    raise WeightsError(f"{wanted} names {len(found)} files; {other_sizes(os.path.join(save_dir, found[0]), '--weight')}"
                       "or pass --hidden_size")


def lora_path(args, config):
    """--lora: a .pth path, or an adapter name in <save_dir>/lora/<name>_<hidden>[_moe].pth (MiniMind's)."""
    if args.lora.endswith(".pth"):
        path = os.path.abspath(args.lora)
    else:
        stem = f"{args.lora}_{config.hidden_size}{'_moe' if getattr(config, 'use_moe', False) else ''}"
        path = os.path.join(typed_or_default(args.save_dir, "out"), "lora", stem + ".pth")
    if not os.path.isfile(path):
        raise ConfigError(f"--lora: {path} does not exist; pass the adapter trainer/train_lora.py wrote")
    return path


def load_chat_model(args):
    """(model in eval mode on --device, tokenizer) from the loading flags; ConfigError, WeightsError or LoraError
    (LOAD_ERRORS) name what to change."""
    check_args(args)
    model, weights = load_model(args)
    if args.inference_rope_scaling:  # MiniMind-3's YaRN at inference: the rotary reads the config at every call
        if not isinstance(model, MiniMindForCausalLM):
            raise ConfigError(f"--inference_rope_scaling applies to MiniMind weights; {weights} is a "
                              f"{type(model).__name__} (its config.json's rope_scaling decides)")
        model.config.inference_rope_scaling = True
    adapter = lora_path(args, model.config) if args.lora else None
    if adapter:  # base + adapter, unmerged (scripts/convert_model.py --lora merges)
        apply_lora_file(model, adapter)
    tokenizer_dir = tokenizer_folder(args, weights)  # the tokenizer the weights record, unless given by hand
    check_tokenizer(tokenizer_dir)
    refusal = vocab_refusal(tokenizer_dir, model.config.vocab_size, weights)  # --force_tokenizer, no sidecar
    if refusal:
        raise ConfigError(refusal)
    lora = f" + LoRA adapter {adapter}{file_digest(adapter)}" if adapter else ""
    print(f"weights {weights}{file_digest(weights)}{lora}, tokenizer {tokenizer_dir}", flush=True)
    return model.eval().to(args.device), AutoTokenizer.from_pretrained(tokenizer_dir)


def check_args(args):
    """Sampling, model and device flags in range, the tokenizer folder present: a ConfigError naming the flag."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1 (got {args.max_new_tokens})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number, 0 (greedy) or more (got {args.temperature})")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must be in (0, 1] (got {args.top_p}); 1 keeps every token")
    if not 0 <= args.seed < 2 ** 32:
        raise ConfigError(f"--seed must be in [0, 2**32) (got {args.seed})")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts",
                 "num_experts_per_tok"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    check_device(args.device)
    if args.load_from and not os.path.isfile(os.path.join(args.load_from, "config.json")):
        raise ConfigError(f"--load_from {args.load_from} has no config.json; it takes a Hugging Face model folder")
    try:
        check_tokenizer(tokenizer_folder(args))
    except ConfigError as e:
        if args.tokenizer_path:
            raise
        raise ConfigError(f"--load_from {args.load_from} holds no tokenizer; pass --tokenizer_path") from e


LOAD_ERRORS = (ConfigError, WeightsError, LoraError, TokenizerMismatch)


def load_or_exit(args):
    """load_chat_model, or one `error: ...` line and exit 2."""
    try:
        return load_chat_model(args)
    except LOAD_ERRORS as e:
        print(f"error: {weights_line(e)}", file=sys.stderr)
        sys.exit(2)
