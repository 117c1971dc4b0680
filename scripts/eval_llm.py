"""Chat with / generate from trained weights, streaming.

    python scripts/eval_llm.py --weight pretrain --prompt "The Python interpreter"
    python scripts/eval_llm.py --load_from out/hf_model --interactive 1        # any HF folder: ours, MiniMind's, Qwen3
    python scripts/eval_llm.py --load_from ./minimind-3 --open_thinking 1 --prompt "Why is the sky blue?"
    python scripts/eval_llm.py --weight full_sft --lora lora_identity   # base + adapter (out/lora/<name>_<hidden>.pth)
    python scripts/eval_llm.py --weight full_sft --inference_rope_scaling 1   # MiniMind-3's YaRN for long prompts

--interactive 1 reads turns from stdin and keeps the conversation history (an empty line or EOF ends it).
Typed relative paths resolve against the current directory, the defaults against the repository root. The library
behind it (loading, rendering, generating) is scripts/inference/.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and the model")

import torch  # noqa: E402

from scripts.inference.flags import add_model_args, add_sampling_args, parsed  # noqa: E402
from scripts.inference.generate import render_prompt, reply  # noqa: E402
from scripts.inference.load import load_or_exit  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here



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
