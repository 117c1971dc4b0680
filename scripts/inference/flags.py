"""The inference flags: loading (weights, LoRA, model shape for a bare .pth, tokenizer, device) and sampling, shared by
eval_llm, eval_toolcall, eval_bench, serve_openai_api and web_demo."""
import os

import torch


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
