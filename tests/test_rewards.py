"""Reward functions (trainer/rl/rewards.py): MiniMind's rule terms on texts worked by hand, the weighted sum, a reward
model against its own forward, user functions by FILE.py:NAME."""
import os

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

from model.errors import ConfigError
from tests.helpers.launch import ROOT
from trainer.rl.rewards import (
    RewardFailed,
    RewardModel,
    load_reward_fn,
    rule_length,
    rule_repetition,
    rule_think,
    score,
)

REWARD_FNS = os.path.join(ROOT, "tests", "helpers", "reward_fns.py")


def as_completions(*texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_rule_terms_by_hand():
    thinking = "Adding the tens and ones gives it."  # 34 characters of reasoning
    texts = ["Too short.",  # 10 characters
             "x" * 20,
             f"{thinking}</think>\n\nThe answer is 7.",
             "ok</think>the the the the the</think>end",  # reasoning of 2 characters, two closing tags
             "a b c a b c a b c"]
    assert rule_length(None, as_completions(*texts)) == [-0.5, 0.5, 0.5, 0.5, -0.5]
    assert rule_think(None, as_completions(*texts)) == [0.0, 0.0, 1.0 + 0.25, -0.5 - 0.25, 0.0]
    # MiniMind's rep_penalty on the answer (after the first </think>), words and punctuation as tokens: at most 0.5,
    # (3-grams - distinct 3-grams) / 3-grams otherwise. 4th: "the" x5 < / think > end: 8 grams, 6 distinct; 5th: 7, 3
    repeated = [0.0, 0.0, 0.0, -(8 - 6) / 8, -min(0.5, (7 - 3) / 7)]
    assert rule_repetition(None, as_completions(*texts)) == pytest.approx(repeated)


def test_score_is_the_weighted_sum_and_none_counts_zero():
    def first(prompts, completions, **columns):
        return [1.0, None, 3.0]

    def second(prompts, completions, gt, **columns):
        return [float(c[0]["content"] == g) for c, g in zip(completions, gt)]
    total, per_function = score([first, second], [0.5, 2.0], [[]] * 3, as_completions("a", "b", "c"),
                                {"gt": ["a", "x", "c"]})
    assert per_function.tolist() == [[1.0, 1.0], [0.0, 0.0], [3.0, 1.0]]
    assert total.tolist() == [0.5 + 2.0, 0.0, 1.5 + 2.0]
    with pytest.raises(RewardFailed, match="reward function first returned 3 values for 2 completions"):
        score([first], [1.0], [[]] * 2, as_completions("a", "b"), {})


def test_a_failing_or_non_finite_reward_function_is_named():
    """An exception, a NaN, an infinity or a float32 overflow: RewardFailed naming the function and the count; a None
    is no reward (0), not a failure."""
    def broken(prompts, completions, **columns):
        raise ZeroDivisionError("division by zero")

    def values(*returned):
        def scorer(prompts, completions, **columns):
            return list(returned)
        return scorer

    completions = as_completions("a", "b", "c")
    with pytest.raises(RewardFailed, match="reward function broken raised ZeroDivisionError: division by zero"):
        score([broken], [1.0], [[]] * 3, completions, {})
    for returned, count in (((float("nan"), 1.0, None), 1), ((float("inf"), float("-inf"), 0.0), 2), ((1e39, 0, 0), 1)):
        with pytest.raises(RewardFailed, match=f"reward function scorer returned {count} non-finite values .* of 3"):
            score([values(*returned)], [1.0], [[]] * 3, completions, {})
    total, _ = score([values(None, 2.0, None)], [1.0], [[]] * 3, completions, {})
    assert total.tolist() == [0.0, 2.0, 0.0]


def test_a_reward_model_scores_its_chat_template_rendering(tmp_path):
    """RewardModel's score: the first logit of the sequence classifier on its own tokenizer's chat template of the
    prompt messages plus the completion, as a forward written out here gives it."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    classifier = Qwen3ForSequenceClassification(config).eval()
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2
    completions = as_completions("4.", "It is five, I think.")
    got = RewardModel(str(tmp_path / "rm"), "cpu")(prompts, completions)
    for messages, completion, value in zip(prompts, completions, got):
        text = tokenizer.apply_chat_template(messages + completion, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            assert value == pytest.approx(float(classifier(input_ids=ids).logits[0, 0]), abs=1e-6)
    assert got[0] != got[1]
    with pytest.raises(ConfigError, match="not a loadable sequence-classification folder"):
        RewardModel(str(tmp_path), "cpu")


def test_a_reward_function_by_file_and_name(tmp_path):
    fn = load_reward_fn(REWARD_FNS + ":digit_share")
    assert fn(None, as_completions("a1b2", "")) == [0.5, 0.0]
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    for spec, message in ((f"{tmp_path}/none.py:f", "does not exist"), ("reward_fns.py", "expected FILE.py:NAME"),
                          (REWARD_FNS + ":missing", "has no function missing"),
                          (f"{tmp_path}/broken.py:f", "importing .* failed \\(RuntimeError: no\\)")):
        with pytest.raises(ConfigError, match=message):
            load_reward_fn(spec)
