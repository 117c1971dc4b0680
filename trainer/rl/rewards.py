"""Reward functions of the RL stages, in TRL's convention: `fn(prompts, completions, **columns) -> list[float]`.

prompts: each row's prompt messages (a list of {"role", "content"} dicts); completions: each completion as
TRL's conversational format, [{"role": "assistant", "content": text}]; columns: the data row's other columns, one
list per name. A None in the returned list means "no reward from this function for this row" (counted as 0); a NaN
or an infinity, an exception or a wrong count stops the run with a line naming the function (RewardFailed).
- `--reward rule`: MiniMind's rule terms, offline: a length term, the think format, a repetition penalty.
- `--reward_model PATH`: a local Hugging Face AutoModelForSequenceClassification (trainer/train_reward.py writes one:
  out/reward_<hidden>_hf); its first logit scores the prompt and the completion rendered by its own tokenizer's chat
  template.
- `--reward_fn FILE.py:NAME` (several allowed): a user's function in the convention above.
The total is the weighted sum over the functions (`--reward_weights`, default 1 each), as TRL's.
"""
import importlib.util
import json
import os
import re

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from model.errors import ConfigError

THINK_END = "</think>"


def completion_texts(completions):
    """Each completion's text: a conversational one's last message (a multi-turn episode's final turn)."""
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def answer_of(text):
    """The answer after the think block (the whole text where there is none)."""
    return text.split(THINK_END, 1)[1].strip() if THINK_END in text else text


def repetition_penalty(text, n=3, cap=0.5):
    """MiniMind's rep_penalty: the share of repeated word 3-grams, scaled to at most `cap`."""
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


def rule_length(prompts, completions, **columns):
    """+0.5 for a reply of 20 to 800 characters, else -0.5 (MiniMind)."""
    return [0.5 if 20 <= len(text.strip()) <= 800 else -0.5 for text in completion_texts(completions)]


def rule_think(prompts, completions, **columns):
    """Where the reply closes a think block: +1.0 for 20 to 300 characters of reasoning (else -0.5), +0.25 for one
    closing tag (else -0.25); 0 without one (MiniMind)."""
    rewards = []
    for text in completion_texts(completions):
        if THINK_END not in text:
            rewards.append(0.0)
            continue
        thinking = text.split(THINK_END, 1)[0].strip()
        rewards.append((1.0 if 20 <= len(thinking) <= 300 else -0.5) + (0.25 if text.count(THINK_END) == 1 else -0.25))
    return rewards


def rule_repetition(prompts, completions, **columns):
    """Minus MiniMind's repetition penalty of the answer (0 to -0.5)."""
    return [-repetition_penalty(answer_of(text)) for text in completion_texts(completions)]


RULES = (rule_length, rule_think, rule_repetition)


def check_reward_model(path):
    """--reward_model names a sequence classifier's folder; one line otherwise (a causal LM's would load with a random
    score head and reward noise)."""
    if not os.path.isdir(path):
        stem = os.path.splitext(path)[0]
        hint = f"; pass {stem}_hf, its sequence classifier" if os.path.isdir(stem + "_hf") else ""
        raise ConfigError(f"--reward_model {path} is not a folder (a Hugging Face "
                          f"AutoModelForSequenceClassification){hint}")
    try:
        with open(os.path.join(path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # RewardModel names what is wrong with the folder when it loads it
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ConfigError(f"--reward_model {path} is a {architectures[0]}, not a reward model (its score head would be "
                          "random); train one with trainer/train_reward.py and pass its out/reward_<hidden>_hf folder")


class RewardModel:
    """A local sequence-classification model as a reward function (name: reward_model)."""

    __name__ = "reward_model"

    def __init__(self, path, device, dtype=torch.float32):
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--reward_model {path}: not a loadable sequence-classification folder ({e})") from None
        self.model = self.model.to(device).eval().requires_grad_(False)
        self.device = device

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns):
        scores = []
        for messages, text in zip(prompts, completion_texts(completions)):
            chat = list(messages) + [{"role": "assistant", "content": text}]
            ids = self.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")
            logits = self.model(input_ids=ids["input_ids"].to(self.device)).logits
            scores.append(float(logits[0, 0]))
        return scores


def load_reward_fn(spec):
    """`FILE.py:NAME` -> the function NAME of that file; ConfigError naming what is wrong."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ConfigError(f"--reward_fn {spec}: expected FILE.py:NAME")
    if not os.path.isfile(path):
        raise ConfigError(f"--reward_fn {spec}: {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error it raises is reported in one line
        raise ConfigError(f"--reward_fn {spec}: importing {path} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"--reward_fn {spec}: {path} has no function {name}")
    return fn


def reward_name(fn):
    return getattr(fn, "__name__", type(fn).__name__)


class RewardFailed(Exception):
    """A reward function raised, returned the wrong count, or returned NaN or an infinity: the message names it."""


def function_values(fn, prompts, completions, columns):
    """(N,) float32 values of one reward function, NaN for its Nones (TRL's "no reward here"); RewardFailed naming
    the function when it raises, returns another count, or returns a NaN or an infinity (which would train as 0 or
    swamp every other reward)."""
    name, count = reward_name(fn), len(completions)
    try:
        raw = list(fn(prompts=prompts, completions=completions, **columns))
        values = torch.tensor([float("nan") if v is None else float(v) for v in raw], dtype=torch.float32)
    except Exception as e:  # the user's function: whatever it raises is reported with its name
        raise RewardFailed(f"reward function {name} raised {type(e).__name__}: {e}") from e
    if len(raw) != count:
        raise RewardFailed(f"reward function {name} returned {len(raw)} values for {count} completions")
    given = torch.tensor([v is not None for v in raw], dtype=torch.bool)
    non_finite = int((given & ~torch.isfinite(values)).sum())  # a float32 overflow (above 3.4e38) counts too
    if non_finite:
        raise RewardFailed(f"reward function {name} returned {non_finite} non-finite values (NaN or infinite) of "
                           f"{count}: return finite numbers, or None for no reward")
    return values


def score(functions, weights, prompts, completions, columns):
    """(total (N,), per function (N, F)) float32 rewards; a function's None counts 0 (TRL's nansum); RewardFailed
    naming the function on a failure (see function_values)."""
    per_function = torch.zeros(len(completions), len(functions))
    for k, fn in enumerate(functions):
        per_function[:, k] = function_values(fn, prompts, completions, columns)
    total = (per_function.nan_to_num(0.0) * torch.tensor(weights, dtype=torch.float32)).sum(1)
    return total, per_function.nan_to_num(0.0)
