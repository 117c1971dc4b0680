"""MiniMind's small helpers: errors, logging, lr schedule, process group, seed, model init, resume sampler."""
import math
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from transformers import AutoTokenizer

from model.model_minimind import MiniMindForCausalLM
from model.weights import WeightsError, load_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ConfigError(Exception):
    """Bad user input: reported as one line, exit code 2, before training starts."""


def repo_path(path):
    """A path relative to the repository root (absolute paths pass through): where defaults live."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def typed_or_default(typed, default):
    """The path rule: a path the user typed resolves against the current directory, a default against the repo."""
    if typed is None:
        return None if default is None else repo_path(default)
    return os.path.abspath(typed)


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def Logger(content):
    if is_main_process():
        print(content, flush=True)


def get_lr(current_step, total_steps, lr, warmup_steps=0):
    """MiniMind's cosine schedule lr*(0.1+0.45*(1+cos(pi*t/T))), after an optional linear warm-up."""
    if warmup_steps > 0 and current_step < warmup_steps:
        return lr * (current_step + 1) / warmup_steps
    t = current_step - warmup_steps
    T = max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, T) / T)))


def init_distributed_mode(timeout_s=60):
    """Start the process group under torchrun (nccl on CUDA, gloo on CPU); return local rank (0 if single)."""
    if int(os.environ.get("RANK", -1)) == -1:
        return 0
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun --max-restarts keeps its store across restarts: without a per-attempt prefix a restarted rank can read
    # a dead worker's address from the last attempt and fail in "Gloo connectFullMesh ... Connection refused"
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return local_rank


def setup_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def weight_name(save_weight, config):
    """MiniMind's weight file stem: <save_weight>_<hidden>[_moe]."""
    return f"{save_weight}_{config.hidden_size}{'_moe' if config.use_moe else ''}"


def init_model(config, tokenizer_path="model", from_weight="none", save_dir="out", device="cpu"):
    """Tokenizer + model; loads out/<from_weight>_<hidden>[_moe].pth (or a .pth / HF folder path) unless 'none'."""
    tokenizer = AutoTokenizer.from_pretrained(repo_path(tokenizer_path))
    model = MiniMindForCausalLM(config)
    if from_weight != "none":
        path = from_weight if from_weight.endswith(".pth") or os.path.isdir(from_weight) else os.path.join(
            repo_path(save_dir), weight_name(from_weight, config) + ".pth")
        try:
            load_weights(model, path)  # strict; a mismatch names the file, tensor, both shapes and the flag
        except WeightsError as e:
            raise ConfigError(str(e)) from None
    Logger(f"Model params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    return model.to(device), tokenizer


class SkipBatchSampler(Sampler):
    """Groups sampler indices into full batches, skipping the first `skip_batches` (for mid-epoch resume)."""

    def __init__(self, sampler, batch_size, skip_batches=0):
        self.sampler, self.batch_size, self.skip_batches = sampler, batch_size, skip_batches

    def __iter__(self):
        batch, seen = [], 0
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                if seen >= self.skip_batches:
                    yield batch
                seen += 1
                batch = []
        # a partial last batch is dropped: every layout then sees the same global batches

    def __len__(self):
        return max(0, len(self.sampler) // self.batch_size - self.skip_batches)
