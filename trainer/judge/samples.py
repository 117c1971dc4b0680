"""Samples at eval time (SFT and later stages): greedy continuations of a few fixed chat prompts, with their repetition
(trainer/judge/units.py), so a run that starts repeating itself shows it while it trains.

Each eval writes one line per prompt to <metrics stem>_samples.jsonl ({"step", "prompt", "text", "ids",
"repeated_4gram", "distinct_2"}) and one record {"step", "sample_repeated_4gram", "sample_distinct_2"} (the means)
to the metrics sinks.
One process generates (the main one) on the whole model: layouts that split it (tp, pp, cp, ep, ZeRO-2/3) have none.
"""
import json
import os
import statistics

import torch

from dataset.prompt_ids import prompt_ids
from trainer.base.launch import is_main_process
from trainer.base.log import Logger
from trainer.judge.units import repetition

PROMPTS = ("Hello, please introduce yourself.", "What is the capital of France?",
           "Write a short story about a cat.", "你好，请介绍一下你自己。")
MAX_NEW_TOKENS = 48


def bare_model(module):
    """The model under torch.compile / DDP wrappers (one process: the whole model)."""
    while True:
        inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
        if inner is None:
            return module
        module = inner


def samples_path(metrics_file):
    return os.path.splitext(metrics_file)[0] + "_samples.jsonl"


def model_is_whole(layout):
    """The main process holds every weight of the model (no tp/pp/cp/ep split, parameters not sharded)."""
    return layout.tp == layout.pp == layout.cp == layout.ep == 1 and layout.zero_stage <= 1


def greedy_samples(model, tokenizer, prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS):
    """[{"prompt", "text", "ids", "repeated_4gram", "distinct_2"}]: each prompt's greedy continuation (chat template,
    the generation prompt added), the model put back in its train/eval mode."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    out = []
    try:
        for prompt in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = torch.tensor([prompt_ids(tokenizer, text)], device=device)
            with torch.no_grad():
                full = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      attention_mask=torch.ones_like(ids))
            new = full[0, ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in new:
                new = new[:new.index(tokenizer.eos_token_id)]
            repeated, distinct2 = repetition(new)
            out.append(dict(prompt=prompt, text=tokenizer.decode(new), ids=new, repeated_4gram=repeated,
                            distinct_2=distinct2))
    finally:
        model.train(was_training)
    return out


class Samples:
    """The callback: at each eval, greedy samples of PROMPTS on the main process, logged as the module says."""

    def __init__(self, tokenizer_path, metrics_file):
        self.tokenizer_path, self.path, self.tokenizer = tokenizer_path, samples_path(metrics_file), None

    def on_eval(self, trainer, record):
        if not is_main_process():
            return
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # a run with samples needs it (the data loading has it loaded)
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        rows = greedy_samples(bare_model(trainer.model_parts[0]), self.tokenizer)
        step = record["step"]
        with open(self.path, "a") as f:
            f.writelines(json.dumps(dict(step=step, **row), ensure_ascii=False) + "\n" for row in rows)
        for row in rows:
            Logger(f"sample at step {step} (repeated 4-grams {row['repeated_4gram']:.0%}, distinct-2 "
                   f"{row['distinct_2']:.2f}): {row['prompt']} -> {row['text'][:120]!r}")
        tracker = next((cb for cb in trainer.callbacks if type(cb).__name__ == "Tracker"), None)
        if tracker is not None:
            tracker.log(dict(step=step, sample_repeated_4gram=statistics.mean(r["repeated_4gram"] for r in rows),
                             sample_distinct_2=statistics.mean(r["distinct_2"] for r in rows)))
