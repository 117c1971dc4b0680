"""Chat with / generate from trained weights, streaming.

    python scripts/eval_llm.py --weight pretrain --prompt "The Python interpreter"
    python scripts/eval_llm.py --load_from out/hf_model --interactive 1        # any HF folder: ours, MiniMind's, Qwen3
    python scripts/eval_llm.py --load_from ./minimind-3 --open_thinking 1 --prompt "Why is the sky blue?"
    python scripts/eval_llm.py --weight full_sft --lora lora_identity   # base + adapter (out/lora/<name>_<hidden>.pth)
    python scripts/eval_llm.py --weight full_sft --inference_rope_scaling 1   # MiniMind-3's YaRN for long prompts

--interactive 1 reads turns from stdin and keeps the conversation history (an empty line or EOF ends it).
Typed relative paths resolve against the current directory, the defaults against the repository root.
"""
import argparse
import json
import math
import os
import queue
import re
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.runtime.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and the model")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer  # noqa: E402
from transformers.generation import BaseStreamer, StoppingCriteria, StoppingCriteriaList  # noqa: E402

from model.lora import LoraError, apply_lora_file  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from model.weight_shapes import WeightsError, weight_fields  # noqa: E402
from model.weights import load_weights, read_weights  # noqa: E402
from trainer.ckpt.tokenizer_choice import TokenizerMismatch, tokenizer_for  # noqa: E402
from trainer.ckpt.weight_flags import weights_line  # noqa: E402
from trainer.ckpt.weights_file import any_weights_record, load_any_weights, read_any_weights  # noqa: E402
from trainer.plan.checks import check_device, check_tokenizer, other_sizes  # noqa: E402
from trainer.plan.resolve import weight_path  # noqa: E402
from trainer.runtime.launch import ConfigError  # noqa: E402
from trainer.trainer_utils import file_digest, typed_or_default  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here


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
    record = any_weights_record(weights).get("tokenizer") if weights else None
    if weights is None or (args.load_from and record is None):
        return typed or args.load_from or typed_or_default(None, "model")
    flag = "--load_from" if args.load_from else "--checkpoint" if args.checkpoint else "--weight"
    folder, note = tokenizer_for(record, typed, typed_or_default(None, "model"), f"{flag} {weights}",
                                 bool(args.force_tokenizer))
    if note:
        print(f"note: {note}", file=sys.stderr)
    return folder


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


def load_model(args):
    """(model, where its weights are): --load_from folder, --checkpoint (a resume checkpoint, config included) or
    out/<weight>_<hidden>[_moe].pth (its config from <weight>_<hidden>[_moe].json beside it; the model flags fill in
    for a .pth without one)."""
    if args.load_from:
        return load_folder(args.load_from), args.load_from
    if args.checkpoint:
        path = os.path.abspath(args.checkpoint)
        _, fields, _ = read_any_weights(path)
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
    return load_any_weights(MiniMindForCausalLM(MiniMindConfig(**fields)), path), path


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
    lora = f" + LoRA adapter {adapter}{file_digest(adapter)}" if adapter else ""
    print(f"weights {weights}{file_digest(weights)}{lora}, tokenizer {tokenizer_dir}", flush=True)
    return model.eval().to(args.device), AutoTokenizer.from_pretrained(tokenizer_dir)


LOAD_ERRORS = (ConfigError, WeightsError, LoraError, TokenizerMismatch)


def render_prompt(tokenizer, messages, chat, open_thinking, tools=None):
    """The text the model continues: the chat template (with the thinking switch and the tool schemas) or bos + raw
    text."""
    if not chat:
        return (tokenizer.bos_token or "") + messages[-1]["content"]
    # MiniMind-3's template reads open_thinking, Qwen3's enable_thinking; a template ignores the one it lacks
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         open_thinking=bool(open_thinking), enable_thinking=bool(open_thinking))


def generate_ids(model, tokenizer, text, max_new_tokens, temperature, top_p, **generate_kwargs):
    """(prompt ids, generated ids, EOS included when reached) of `text`'s continuation: temperature 0 is greedy."""
    # no token_type_ids: transformers 4.x tokenizers return them and generate() rejects them
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    inputs = inputs.to(model.device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **sampling, **generate_kwargs)
    return inputs.input_ids[0].cpu(), out[0, inputs.input_ids.shape[1]:].cpu()


class _TokenQueue(BaseStreamer):
    """generate() hands it the prompt, then each new token; None marks the end."""

    def __init__(self):
        self.tokens, self.prompt_seen = queue.Queue(), False

    def put(self, value):
        if self.prompt_seen:
            for token in value.reshape(-1).tolist():
                self.tokens.put(token)
        self.prompt_seen = True

    def end(self):
        self.tokens.put(None)


class _StopFlag(StoppingCriteria):
    """Stops generate() at the next token once the event is set (a streaming client went away)."""

    def __init__(self, event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_ids(model, tokenizer, text, max_new_tokens, temperature, top_p):
    """Yield the generated token ids (EOS included when reached) as generate() makes them in a thread; the same
    tokens as generate_ids. Closing the generator stops generation at the next token."""
    tokens, stop, failure = _TokenQueue(), threading.Event(), []

    def run():
        try:
            generate_ids(model, tokenizer, text, max_new_tokens, temperature, top_p, streamer=tokens,
                         stopping_criteria=StoppingCriteriaList([_StopFlag(stop)]))
        except Exception as e:  # re-raised in the caller's thread
            failure.append(e)
            tokens.end()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while (token := tokens.tokens.get()) is not None:
            yield token
    finally:
        stop.set()
        thread.join()
    if failure:
        raise failure[0]


def reply(model, tokenizer, text, args):
    """Stream the continuation of `text` to stdout; return it decoded."""
    streamer = ReplyStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    _, new_ids = generate_ids(model, tokenizer, text, args.max_new_tokens, args.temperature, args.top_p,
                              streamer=streamer)
    return tokenizer.decode(new_ids, skip_special_tokens=True)


class ReplyStreamer(TextStreamer):
    """TextStreamer without the reply's leading whitespace (a small model's reply often opens with blank lines)."""

    def on_finalized_text(self, text, stream_end=False):
        if not getattr(self, "started", False):
            text = text.lstrip()
            self.started = bool(text)
        super().on_finalized_text(text, stream_end)


def add_model_args(parser, weight="pretrain"):
    """The loading flags (weights, LoRA, model shape for a bare .pth, tokenizer, device): eval_llm's, shared by
    eval_toolcall, serve_openai_api and web_demo."""
    parser.add_argument("--load_from", default=None,
                        help="a Hugging Face folder (ours, MiniMind's, Qwen3) instead of --weight")
    parser.add_argument("--save_dir", default=None, help="where --weight files are (default: the repo's out/)")
    parser.add_argument("--weight", default=weight, help="weight prefix (pretrain, full_sft, ...) or a .pth path")
    parser.add_argument("--checkpoint", default=None,
                        help="a resume checkpoint (checkpoints/<weight>_<hidden>/step_<N>) instead of --weight")
    parser.add_argument("--tokenizer_path", default=None,
                        help="default: the tokenizer the weights record (their sidecar, checkpoint or folder), else "
                        "the repo's model/")
    parser.add_argument("--force_tokenizer", type=int, default=0, choices=[0, 1],
                        help="1: use --tokenizer_path even where it is not the tokenizer the weights record")
    parser.add_argument("--lora", "--lora_weight", dest="lora", default=None,
                        help="a LoRA adapter on top: a .pth (MiniMind's format) or a name in <save_dir>/lora/")
    parser.add_argument("--hidden_size", type=int, default=None,
                        help="picks <weight>_<hidden_size>.pth; default: the one file of that prefix (its sidecar "
                        "holds the size), 768 for a bare .pth")
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--num_attention_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--use_moe", type=int, default=0, choices=[0, 1])
    parser.add_argument("--num_experts", type=int, default=4)
    parser.add_argument("--num_experts_per_tok", type=int, default=1)
    parser.add_argument("--inference_rope_scaling", type=int, nargs="?", const=1, default=0, choices=[0, 1],
                        help="1 (or the bare flag, as in MiniMind): YaRN RoPE scaling, factor 16 over 2048 positions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def add_sampling_args(parser, max_new_tokens=128, temperature=0.85):
    """The generation flags: thinking switch, length, temperature (0: greedy), top_p, seed."""
    parser.add_argument("--open_thinking", type=int, default=0, choices=[0, 1],
                        help="leave the think block open for the model to reason (open_thinking / enable_thinking "
                        "in the template)")
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)


def parsed(parser, argv):
    """parser.parse_args(argv) with --load_from made absolute (typed paths follow the cwd)."""
    args = parser.parse_args(argv)
    if args.load_from:
        args.load_from = os.path.abspath(args.load_from)
    return args


def load_or_exit(args):
    """load_chat_model, or one `error: ...` line and exit 2."""
    try:
        return load_chat_model(args)
    except LOAD_ERRORS as e:
        print(f"error: {weights_line(e)}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    """The flags; --load_from made absolute."""
    parser = argparse.ArgumentParser(description="MiniMind text generation and chat")
    add_model_args(parser)
    parser.add_argument("--prompt", default=None, help="text to continue (or a chat turn with --chat 1)")
    parser.add_argument("--interactive", type=int, default=0, choices=[0, 1],
                        help="multi-turn chat from stdin, with history")
    parser.add_argument("--chat", type=int, default=None, choices=[0, 1],
                        help="apply the chat template (default: on unless pretrain)")
    add_sampling_args(parser)
    return parsed(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load_or_exit(args)
    torch.manual_seed(args.seed)
    chat = bool(args.chat if args.chat is not None else (args.load_from or args.weight != "pretrain"))
    if args.interactive:
        messages = []
        for line in sys.stdin:
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.strip()})
            print(f"\n>>> {line.strip()}\n", end="", flush=True)
            answer = reply(model, tokenizer, render_prompt(tokenizer, messages, chat, args.open_thinking), args)
            messages = messages + [{"role": "assistant", "content": answer}] if chat else []
        return
    prompts = [args.prompt] if args.prompt else ["The Python interpreter", "What is a list comprehension?", "你好"]
    for prompt in prompts:
        print(f"\n>>> {prompt}\n", end="", flush=True)
        reply(model, tokenizer, render_prompt(tokenizer, [{"role": "user", "content": prompt}], chat,
                                              args.open_thinking), args)


if __name__ == "__main__":
    main()
