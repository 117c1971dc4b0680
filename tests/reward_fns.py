"""Reward functions in TRL's convention for the RL tests (--reward_fn tests/reward_fns.py:NAME)."""


def distinct_chars(prompts, completions, **columns):
    """The number of distinct characters of each completion, over 10: differs between most completions."""
    return [len(set(c[0]["content"])) / 10 for c in completions]
