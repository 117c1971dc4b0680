"""The TRL side of the peer benchmark (scripts/bench_peers.py): one TRL trainer (DPOTrainer, SFTTrainer, GRPOTrainer)
on the rows the bench prepared, run as `python -m scripts.benchmarks.trl_peer SPEC.json` in its own process, in the
environment of requirements-bench.txt (TRL is never a runtime dependency). It writes its step times, target tokens,
losses and peak memory to the spec's `out` file.

The rows are the project's own, so that both sides train on the same tokens in the same order: DPO's pairs as TRL's
tokenized columns (prompt_ids, chosen_ids, rejected_ids: the labelled span of each side), SFT's packed rows as
input_ids, labels and seq_lengths (TRL's padding-free batches), GRPO's prompts as conversations; TRL's sampler then
reads them in order (the project's data order for seed and epoch 0, computed by the bench).
"""
import importlib.util
import json
import resource
import sys
import time

import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback


class StepClock(TrainerCallback):
    """At each optimizer step's end: the wall and CPU clocks and the target tokens so far (counted in compute_loss),
    as the project's side records them (scripts/benchmarks/peers.py CLOCK)."""

    def __init__(self):
        self.ends, self.pending = [], 0

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), time.process_time(), self.pending))


def peer_class(base, clock, count, in_order=True):
    """`base` (a TRL trainer) reading its dataset in order (GRPO: its own sampler, which repeats each prompt once per
    generation), its rows as given (no tokenization), counting the target tokens of every micro-batch with
    `count(inputs)`."""
    class Peer(base):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset) if in_order else super()._get_train_sampler(*args, **kwargs)

        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

        def compute_loss(self, model, inputs, *args, **kwargs):
            clock.pending += int(count(inputs))
            return super().compute_loss(model, inputs, *args, **kwargs)
    return Peer


def common_args(spec):
    """TrainingArguments both stages share: the bench's batch, steps, dtype, optimizer and learning rate."""
    return dict(output_dir=spec["work"], per_device_train_batch_size=spec["micro_batch"],
                gradient_accumulation_steps=spec["accumulation_steps"], max_steps=spec["max_steps"],
                learning_rate=spec["learning_rate"], lr_scheduler_type="cosine", warmup_steps=0,
                weight_decay=0.01, max_grad_norm=1.0, optim="adamw_torch_fused", bf16=spec["dtype"] == "bfloat16",
                gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True,
                remove_unused_columns=False)


def dpo_trainer(spec, model, tokenizer, clock):
    from trl import DPOConfig, DPOTrainer  # optional dependency: the bench's environment only
    args = DPOConfig(**common_args(spec), beta=spec["beta"], max_length=spec["seq_len"],
                     precompute_ref_log_probs=True, loss_type=["sigmoid"])
    trainer_class = peer_class(DPOTrainer, clock, lambda inputs: inputs["completion_mask"][:, 1:].sum())
    return trainer_class(model=model, args=args, train_dataset=Dataset.from_list(spec["rows"]),
                         processing_class=tokenizer)


def sft_trainer(spec, model, tokenizer, clock):
    from trl import SFTConfig, SFTTrainer  # optional dependency: the bench's environment only
    args = SFTConfig(**common_args(spec), packing=False, padding_free=True, max_length=None,
                     dataset_kwargs={"skip_prepare_dataset": True})
    trainer_class = peer_class(SFTTrainer, clock, lambda inputs: (inputs["labels"][:, 1:] != -100).sum())
    return trainer_class(model=model, args=args, train_dataset=Dataset.from_list(spec["rows"]),
                         processing_class=tokenizer)


def grpo_trainer(spec, model, tokenizer, clock):
    from trl import GRPOConfig, GRPOTrainer  # optional dependency: the bench's environment only
    module_spec = importlib.util.spec_from_file_location("peer_reward", spec["reward_file"])  # the bench's reward file
    reward = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(reward)
    generations = spec["num_generations"]
    args = GRPOConfig(**dict(common_args(spec), per_device_train_batch_size=spec["micro_batch"] * generations),
                      num_generations=generations, max_completion_length=spec["max_gen_len"], temperature=1.0,
                      top_p=1.0, beta=0.0, loss_type="grpo", num_iterations=1, use_vllm=False)
    trainer_class = peer_class(GRPOTrainer, clock, lambda inputs: inputs["completion_mask"].sum(), in_order=False)
    return trainer_class(model=model, args=args, reward_funcs=reward.reward,
                         train_dataset=Dataset.from_list(spec["rows"]), processing_class=tokenizer)


TRAINERS = {"dpo": dpo_trainer, "sft": sft_trainer, "grpo": grpo_trainer}


def main(path):
    with open(path) as f:
        spec = json.load(f)
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    clock = StepClock()
    trainer = TRAINERS[spec["stage"]](spec, model, tokenizer, clock)
    trainer.add_callback(clock)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB: Linux reports KiB, as the trainer reads it
    result = dict(ends=clock.ends, losses=losses, peak_mem_gb=peak)
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
