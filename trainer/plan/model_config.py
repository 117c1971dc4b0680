"""The MiniMindConfig the flags describe, with the shapes of a --from_weight file taking precedence; vocab_size follows
the tokenizer (model/tokenizer_choice.py: model_vocab_size), and a tokenizer with more ids than the model has rows is
refused (check_vocab)."""
from model.errors import ConfigError
from model.model_minimind import MiniMindConfig
from model.tokenizer_choice import check_tokenizer, model_vocab_size, vocab_refusal
from model.weights.flag_advice import flag_conflicts, weights_line
from model.weights.paths import typed_or_default
from model.weights.shapes import WeightsError, infer_config
from trainer.base.log import Logger
from trainer.ckpt.weights_file import read_any_weights
from trainer.plan.flags import MODEL_FLAGS


def build_config(args, weight_fields=None, tokenizer_path=None):
    """The MiniMindConfig the flags describe (None sizes keep the model's own rule) and vocab_size the tokenizer's
    (`tokenizer_path`, else --tokenizer_path or model/); `weight_fields`, the shapes of the --from_weight file (see
    weight_shapes), take precedence over both."""
    fields = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name, None) is not None}
    fields["use_moe"] = bool(fields["use_moe"])
    fields.update(weight_fields or {})
    if "vocab_size" not in fields:
        tokenizer_path = tokenizer_path or typed_or_default(getattr(args, "tokenizer_path", None), "model")
        check_tokenizer(tokenizer_path)
        fields["vocab_size"] = model_vocab_size(tokenizer_path)
    return MiniMindConfig(max_position_embeddings=max(32768, args.max_seq_len), loss_chunk_size=args.loss_chunk_size,
                          dropout=getattr(args, "dropout", 0.0), **fields)


def check_vocab(config, tokenizer_path, from_weight):
    """A tokenizer whose ids reach past the model's embedding rows is refused in one line: only a --from_weight
    file's rows can be fewer than the tokenizer's ids."""
    refusal = vocab_refusal(tokenizer_path, config.vocab_size, f"--from_weight {from_weight}")
    if refusal:
        raise ConfigError(refusal)


def weight_shapes(args, path):
    """The model fields a --from_weight file fixes (from its tensors, and top-k from its saved config); one line
    says which flags they override, so a MiniMind-3 .pth or an older run's weights load without size flags."""
    try:
        state_dict, saved_config, _ = read_any_weights(path)
        fields = infer_config(state_dict)
    except WeightsError as e:
        raise ConfigError(flag_error("--from_weight", path, e)) from None
    if saved_config and "num_experts_per_tok" in saved_config and fields["use_moe"]:
        fields["num_experts_per_tok"] = saved_config["num_experts_per_tok"]
    flags = {name: getattr(args, name) for name in MODEL_FLAGS if name != "use_moe"}
    conflicts = flag_conflicts(fields, dict(flags, use_moe=bool(args.use_moe)))
    if conflicts:
        Logger(f"--from_weight {path}: the model takes the weights' shapes, not the flags: {'; '.join(conflicts)}")
    return fields


def flag_error(flag, path, error):
    """One line naming the weights flag and its file: `error` prefixed by them (the file once, where it names it)."""
    message = weights_line(error)  # with the flag that fixes it, where one does
    return f"{flag}: {message}" if message.startswith(path) else f"{flag} {path}: {message}"
