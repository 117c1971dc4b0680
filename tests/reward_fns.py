"""Reward functions in TRL's convention for the RL tests (--reward_fn tests/reward_fns.py:NAME)."""


def distinct_chars(prompts, completions, **columns):
    """The number of distinct characters of each completion, over 10: differs between most completions."""
    return [len(set(c[0]["content"])) / 10 for c in completions]


def digit_share(prompts, completions, **columns):
    """The toy task's verifiable reward: the share of a completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(1, len(c[0]["content"])) for c in completions]


def constant(prompts, completions, **columns):
    """The same reward for every completion: every group's rewards are equal."""
    return [0.25] * len(completions)
