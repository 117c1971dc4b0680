"""Generate text from trained weights, streaming: `python scripts/eval_llm.py --weight pretrain --prompt "..."`."""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoTokenizer, TextStreamer  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.trainer_utils import repo_path, weight_name  # noqa: E402


def load_model(args):
    """Weights from out/<weight>_<hidden>[_moe].pth, or from a resume checkpoint (its config included)."""
    if args.checkpoint:
        ckpt = torch.load(repo_path(args.checkpoint), map_location="cpu", weights_only=False)
        config = MiniMindConfig(**{k: v for k, v in ckpt["config"].items() if k not in ("model_type", "transformers_version")})
        state = ckpt["model"]
    else:
        config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                                use_moe=bool(args.use_moe), num_experts=args.num_experts,
                                num_experts_per_tok=args.num_experts_per_tok)
        path = os.path.join(repo_path(args.save_dir), weight_name(args.weight, config) + ".pth")
        if not os.path.isfile(path):
            sys.exit(f"error: {path} does not exist; train it first or pass --weight/--hidden_size/--checkpoint")
        state = torch.load(path, map_location="cpu")
    model = MiniMindForCausalLM(config)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval().to(args.device)


def main():
    parser = argparse.ArgumentParser(description="MiniMind text generation")
    parser.add_argument("--save_dir", default="out")
    parser.add_argument("--weight", default="pretrain", help="weight prefix: pretrain, full_sft, ...")
    parser.add_argument("--checkpoint", default=None, help="a checkpoints/*_resume.pth instead of --weight")
    parser.add_argument("--tokenizer_path", default="model")
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--num_attention_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--use_moe", type=int, default=0, choices=[0, 1])
    parser.add_argument("--num_experts", type=int, default=4)
    parser.add_argument("--num_experts_per_tok", type=int, default=1)
    parser.add_argument("--prompt", default=None, help="text to continue (or a chat turn with --chat 1)")
    parser.add_argument("--chat", type=int, default=None, help="apply the chat template (default: on unless pretrain)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.85)
    parser.add_argument("--top_p", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(repo_path(args.tokenizer_path))
    model = load_model(args)
    chat = args.chat if args.chat is not None else args.weight != "pretrain"
    prompts = [args.prompt] if args.prompt else ["The Python interpreter", "What is a list comprehension?", "你好"]
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True) if chat else tokenizer.bos_token + prompt
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(args.device)
        print(f"\n>>> {prompt}\n", end="", flush=True)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature, top_p=args.top_p, streamer=streamer,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


if __name__ == "__main__":
    main()
