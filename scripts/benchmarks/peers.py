"""The peer benchmark's parts (scripts/bench_peers.py): the shared starting model (one MiniMind init exported as a
Hugging Face folder that both sides load), each stage's rows for both sides, one run of each side, and their figures.

The project's side is the real trainer (scripts/benchmarks/run.py run_trainer); TRL's runs in its own process
(scripts/benchmarks/trl_peer.py) on the project's own token rows, in the project's data order, so that both train on
the same tokens step by step and their step-1 losses can be compared.
"""
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from dataset.chat import SFTDataset
from dataset.demo_data import ensure_demo_data
from dataset.preference_data import DPODataset
from model.hf_convert import save_hf_folder
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.provenance import copy_tokenizer
from model.weights.paths import ROOT
from scripts.benchmarks.run import run_trainer

SCRIPTS = {"dpo": "train_dpo.py", "sft": "train_full_sft.py", "grpo": "train_grpo.py"}
SEED = 42
# the rule reward both sides score completions with (TRL's convention: a list of floats per call): distinct words
REWARD = '''def reward(prompts, completions, **kwargs):
    words = [completion[0]["content"].split() for completion in completions]
    return [len(set(w)) / (1 + len(w)) for w in words]
'''


# the project's side clocks its steps as TRL's does (trl_peer.py StepClock): a --callbacks file of the trainer
CLOCK = '''import json, time


class StepClock:
    def __init__(self):
        self.ends = []

    def on_step_end(self, trainer, record):
        self.ends.append((time.perf_counter(), time.process_time(), trainer.progress.tokens_seen))

    def on_train_end(self, trainer):
        with open({path!r}, "w") as f:
            json.dump(self.ends, f)
'''


def export_model(work, config_fields):
    """A seeded MiniMind init written as a Hugging Face folder with the repository's tokenizer: both sides' start."""
    folder = os.path.join(work, "model_hf")
    torch.manual_seed(SEED)
    model = MiniMindForCausalLM(MiniMindConfig(**config_fields))
    save_hf_folder(model.state_dict(), model.config, folder, torch.float32)
    copy_tokenizer(os.path.join(ROOT, "model"), folder)
    return folder


def data_order(dataset):
    """The project's sample order of epoch 0 (trainer/core/data_loading.py: DistributedSampler, seed, one rank)."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
    sampler.set_epoch(0)
    return list(sampler)


def write_lines(path, lines):
    with open(path, "w") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
    return path


def demo_lines(kind):
    with open(ensure_demo_data(kind)) as f:
        return [line for line in f if line.strip()]


def labelled_span(labels):
    """(first, last + 1) of a row's labels when they are one contiguous run, else None."""
    hits = np.flatnonzero(labels.numpy() != -100)
    return (int(hits[0]), int(hits[-1]) + 1) if len(hits) and hits[-1] - hits[0] + 1 == len(hits) else None


def dpo_rows(work, tokenizer, pairs, seq_len):
    """(the project's data file, TRL's rows in the project's order): `pairs` single-turn pairs of the demo corpus whose
    two sides share their prompt; TRL's rows are each side's labelled span after that prompt."""
    lines = demo_lines("dpo")
    full = DPODataset(write_lines(os.path.join(work, "dpo_all.jsonl"), lines), tokenizer, max_length=seq_len,
                      cache_dir=os.path.join(work, "cache"))
    kept = []
    for i in range(len(full)):
        ids, labels = full[i][:2]
        spans = [labelled_span(labels[k]) for k in (0, 1)]
        if all(spans) and spans[0][0] == spans[1][0] and torch.equal(ids[0, :spans[0][0]], ids[1, :spans[1][0]]):
            kept.append(int(full.pairs[i]))
        if len(kept) == pairs:
            break
    path = write_lines(os.path.join(work, "dpo.jsonl"), [lines[row] for row in kept])
    ds = DPODataset(path, tokenizer, max_length=seq_len, cache_dir=os.path.join(work, "cache"))
    rows = []
    for i in data_order(ds):
        ids, labels = ds[i][:2]
        (a, b), (c, d) = labelled_span(labels[0]), labelled_span(labels[1])
        rows.append(dict(prompt_ids=ids[0, :a].tolist(), chosen_ids=ids[0, a:b].tolist(),
                         rejected_ids=ids[1, c:d].tolist()))
    return path, rows


def sft_rows(work, tokenizer, conversations, seq_len):
    """(the project's data file, TRL's rows in the project's order): the packed rows of the first `conversations` of
    the demo corpus, each as its tokens, labels and conversation lengths (TRL's padding-free batches)."""
    path = write_lines(os.path.join(work, "sft.jsonl"), demo_lines("sft")[:conversations])
    ds = SFTDataset(path, tokenizer, max_length=seq_len, cache_dir=os.path.join(work, "cache"), packing=True,
                    doc_mask=True)
    rows = []
    for i in data_order(ds):
        docs = ds.row_docs[ds.row_offsets[i]:ds.row_offsets[i + 1]]
        lengths = [int(min(ds.offsets[d + 1] - ds.offsets[d], seq_len)) for d in docs]
        ids, labels = ds[i][:2]
        n = sum(lengths)
        rows.append(dict(input_ids=ids[:n].tolist(), labels=labels[:n].tolist(), seq_lengths=lengths))
    return path, rows


def grpo_rows(work, prompts):
    """(the project's data file, TRL's rows in the project's order): the first `prompts` RL prompts of the demo
    corpus, each the conversation less its reference answer."""
    lines = demo_lines("rlaif")[:prompts]
    path = write_lines(os.path.join(work, "grpo.jsonl"), lines)
    messages = [json.loads(line)["conversations"] for line in lines]
    prompt = [m[:-1] if m[-1]["role"] == "assistant" else m for m in messages]
    return path, [dict(prompt=prompt[i]) for i in data_order(prompt)]


def step_figures(ends, warmup):
    """From (wall clock, CPU clock, target tokens so far) at each step's end: target tokens/s (median tokens / median
    time), steps/s, and tokens per CPU-second (the process's own time: what the load of other processes leaves
    alone) over the steps after `warmup`."""
    steps = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(ends, ends[1:])][max(warmup - 1, 0):]
    wall, cpu, tokens = (list(column) for column in zip(*steps))
    step, step_cpu, step_tokens = statistics.median(wall), statistics.median(cpu), statistics.median(tokens)
    return dict(tokens_per_sec=step_tokens / step, steps_per_sec=1 / step, tokens_per_cpu_sec=step_tokens / step_cpu,
                step_time_median=step, steps=len(steps), step_times=[round(t, 4) for t in wall],
                step_cpu_times=[round(t, 4) for t in cpu], tokens=tokens)


def ours_run(stage, flags, work, log_path, warmup):
    """The project's trainer for `stage`, its steps clocked by CLOCK (a --callbacks file): its figures and losses."""
    clock, ends = os.path.join(work, "clock.py"), os.path.join(work, "ends.json")
    with open(clock, "w") as f:
        f.write(CLOCK.format(path=ends))
    records = run_trainer(dict(flags, callbacks=f"{clock}:StepClock"), log_path,
                          script=os.path.join(ROOT, "trainer", SCRIPTS[stage]))
    steps = sorted((r for r in records if "tokens_per_sec" in r), key=lambda r: r["step"])
    with open(ends) as f:
        return dict(step_figures(json.load(f), warmup), losses=[r["loss"] for r in steps],
                    peak_mem_gb=max(r["peak_mem_gb"] for r in steps))


def trl_run(spec, log_path, warmup):
    """TRL's trainer for spec["stage"] in its own process (scripts/benchmarks/trl_peer.py): its figures and losses."""
    spec_path = os.path.join(spec["work"], "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with open(log_path, "w") as log:
        code = subprocess.run([sys.executable, "-m", "scripts.benchmarks.trl_peer", spec_path], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log_path) as log:
            raise RuntimeError(f"TRL's {spec['stage']} exited with {code}; log {log_path}:\n{log.read()[-3000:]}")
    with open(spec["out"]) as f:
        result = json.load(f)
    return dict(step_figures(result["ends"], warmup), losses=result["losses"], peak_mem_gb=result["peak_mem_gb"])
