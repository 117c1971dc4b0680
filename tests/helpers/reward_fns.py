"""Reward functions in TRL's convention for the RL tests (--reward_fn tests/helpers/reward_fns.py:NAME)."""


def distinct_chars(prompts, completions, **columns):
    """The number of distinct characters of each completion, over 10: differs between most completions."""
    return [len(set(c[0]["content"])) / 10 for c in completions]


def digit_share(prompts, completions, **columns):
    """The toy task's verifiable reward: the share of a completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(1, len(c[0]["content"])) for c in completions]


def constant(prompts, completions, **columns):
    """The same reward for every completion: every group's rewards are equal."""
    return [0.25] * len(completions)


def nan_for_some(prompts, completions, **columns):
    """A NaN for every other completion (a broken scorer), None for none of them."""
    return [float("nan") if i % 2 else 0.5 for i in range(len(completions))]


def infinite(prompts, completions, **columns):
    """+inf for the first completion, 1.0 for the others."""
    return [float("inf")] + [1.0] * (len(completions) - 1)


CALLS = []  # this module's calls so far (each run loads the file afresh)


def fails_at_step_3(prompts, completions, **columns):
    """distinct_chars, but it raises on its fifth call: step 3's first micro-batch at 2 micro-batches a step."""
    CALLS.append(len(completions))
    if len(CALLS) == 5:
        raise KeyError("score_service")
    return distinct_chars(prompts, completions)
