"""Pair accuracy of a reward model: how often it scores the chosen answer of a DPO-format pair above the rejected one.

    python scripts/eval_reward.py --reward_model out/reward_256_hf
    python scripts/eval_reward.py --reward_model out/reward_256_hf --data_path held_out.jsonl --max_seq_len 256

The model is what --reward_model reads in GRPO/PPO (trainer/rl/rewards.py: a sequence classifier's folder, such as
trainer/train_reward.py's <name>_hf); each side is rendered by the folder's tokenizer as SFT renders a conversation
(dataset/chat.py), cut at --max_seq_len, and scored at its last token. Prints the accuracy and the mean score gap.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and the reward model")

import torch  # noqa: E402

from dataset.chat import chat_messages  # noqa: E402
from dataset.demo_data import ensure_demo_data  # noqa: E402
from model.errors import ConfigError  # noqa: E402
from trainer.rl.rewards import RewardModel, check_reward_model  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here


@torch.no_grad()
def side_score(reward_model, conversation, max_seq_len):
    """The model's score of one conversation (a list of messages) as SFT renders it."""
    messages, tools = chat_messages(conversation)
    text = reward_model.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    ids = reward_model.tokenizer(text, add_special_tokens=False)["input_ids"][:max_seq_len]
    return float(reward_model.model(input_ids=torch.tensor([ids], device=reward_model.device)).logits[0, 0])


def pair_accuracy(reward_model, rows, max_seq_len):
    """(share of pairs whose chosen side scores higher, mean chosen - rejected score gap)."""
    gaps = [side_score(reward_model, row["chosen"], max_seq_len) - side_score(reward_model, row["rejected"],
                                                                               max_seq_len) for row in rows]
    return sum(gap > 0 for gap in gaps) / len(gaps), sum(gaps) / len(gaps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward_model", required=True, help="a sequence classifier's folder (out/reward_<hidden>_hf)")
    parser.add_argument("--data_path", default=None, help="DPO-format pairs (default: the embedded demo pairs)")
    parser.add_argument("--max_seq_len", type=int, default=1024, help="tokens per side, as in training")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        check_reward_model(args.reward_model)
        reward_model = RewardModel(args.reward_model, args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    path = args.data_path or ensure_demo_data("dpo")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    accuracy, gap = pair_accuracy(reward_model, rows, args.max_seq_len)
    print(f"{len(rows)} pairs of {path}: accuracy {accuracy:.4f}, mean score gap {gap:.4f}")


if __name__ == "__main__":
    main()
