"""Rollout speed: the rollout engine's sampling loop (trainer/rl/rollout.py) against transformers' `generate` on the
same model, prompts and sampling settings; tokens generated per second, best of --repeats (interleaved).

  python scripts/bench_rollout.py --hidden_size 768 --num_hidden_layers 8 --rows 12 --new_tokens 128
Both run every row to --new_tokens (no EOS), so they generate the same number of tokens.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.rl.rollout import sample  # noqa: E402


def timed(fns, repeats):
    """[(best seconds, last result)] of each of `fns`, called in turn `repeats` times (interleaved, so a change of
    load on a shared machine hits both alike)."""
    best, results = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, results))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=12, help="completions generated at once (prompts x generations)")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers)
    model = MiniMindForCausalLM(config).to(args.device).eval()
    prompts = torch.randint(3, config.vocab_size, (args.rows, args.prompt_len), device=args.device)
    lengths = torch.full((args.rows,), args.prompt_len, device=args.device)
    tokens = args.rows * args.new_tokens

    def own():
        generator = torch.Generator(args.device).manual_seed(0)
        return sample(model, prompts, lengths, args.new_tokens, args.temperature, 1.0, -1, 0, generator)

    def hf():
        with torch.no_grad():
            return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                  temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, pad_token_id=0)
    (own_s, rollout), (hf_s, output) = timed([own, hf], args.repeats)
    assert rollout.generated_tokens == tokens and output.shape[1] - args.prompt_len == args.new_tokens
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{params:.1f}M params on {args.device}, {args.rows} rows x {args.prompt_len} prompt + {args.new_tokens} new "
          f"tokens, threads {torch.get_num_threads()}")
    print(f"rollout engine (KV cache, log-probs at T): {tokens / own_s:8.0f} tokens/s")
    print(f"transformers generate (KV cache):          {tokens / hf_s:8.0f} tokens/s  ({own_s / hf_s:.2f}x the time)")


if __name__ == "__main__":
    main()
