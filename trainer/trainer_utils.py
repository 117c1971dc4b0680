"""Small helpers shared by the training scripts (MiniMind's trainer_utils, plus exact resume)."""
import math
import os
import random
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from model.model_minimind import MiniMindForCausalLM  # noqa: E402


class ConfigError(Exception):
    """Bad user input: reported as one line, exit code 2, before training starts."""


def repo_path(path):
    """Resolve a default path against the repository root (absolute paths pass through)."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


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
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
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
    """Tokenizer + model; loads out/<from_weight>_<hidden>[_moe].pth (or a given .pth path) unless 'none'."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(repo_path(tokenizer_path))
    model = MiniMindForCausalLM(config)
    if from_weight != "none":
        path = from_weight if from_weight.endswith(".pth") else os.path.join(
            repo_path(save_dir), weight_name(from_weight, config) + ".pth")
        state = torch.load(path, map_location="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise ConfigError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
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


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj, path):
    """torch.save to a temporary file, fsync, then rename: a killed save never leaves a valid-looking file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


CHECK_KEYS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "num_experts")


def resume_path(config, weight="pretrain", save_dir="checkpoints"):
    return os.path.join(repo_path(save_dir), weight_name(weight, config) + "_resume.pth")


def lm_checkpoint(config, weight="pretrain", state=None, save_dir="checkpoints"):
    """Save `state` (a dict; see train_loop.checkpoint_state) atomically, or load and check it.

    Load returns None when no checkpoint exists; raises ConfigError naming the file and the mismatch
    when it is corrupt or was written for a different model.
    """
    path = resume_path(config, weight, save_dir)
    if state is not None:
        atomic_save(dict(state, config=config.to_dict(), format_version=1), path)
        return path
    if not os.path.exists(path):
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        saved = ckpt["config"]
    except Exception as e:
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it or pass --from_resume 0")
    for key in CHECK_KEYS:
        if saved.get(key) != getattr(config, key):
            raise ConfigError(f"{path} was saved with {key}={saved.get(key)} but this run has "
                              f"{key}={getattr(config, key)}; match the flags or pass --from_resume 0")
    return ckpt


def model_flops_per_token(config, seq_len):
    """Training FLOPs per token: 6 x parameters touched per token + causal attention (MoE: active experts only)."""
    h, L, hd = config.hidden_size, config.num_hidden_layers, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attn_params = h * q + 2 * h * kv + q * h
    if config.use_moe:
        inter = config.moe_intermediate_size
        mlp_params = 3 * h * inter * (config.num_experts_per_tok + config.n_shared_experts) + h * config.num_experts
    else:
        mlp_params = 3 * h * config.intermediate_size
    params = L * (attn_params + mlp_params) + config.vocab_size * h  # lm_head (embedding lookup is free)
    attn_flops = 6 * L * q * seq_len  # fwd 2*2*q*seq/2 (causal) per token, x3 for fwd+bwd
    return 6 * params + attn_flops


def lm_head_flops_per_token(config):
    """The lm_head's share of model_flops_per_token (the chunked loss runs it on target tokens only)."""
    return 6 * config.vocab_size * config.hidden_size


def step_flops(config, seq_len, positions, target_tokens, head_on_targets_only):
    """Training FLOPs of `positions` tokens of which `target_tokens` carry a label: the body runs on every
    position; the lm_head too, unless the chunked loss runs it on target tokens only."""
    head = lm_head_flops_per_token(config)
    body = model_flops_per_token(config, seq_len) - head
    return body * positions + head * (target_tokens if head_on_targets_only else positions)


_PEAK_CACHE = {}


def peak_flops(device, dtype):
    """Device peak FLOP/s: CUDA from a table (dense, no sparsity); CPU measured once by a matmul probe."""
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40": 181e12, "4090": 165e12, "3090": 71e12}
        peak = next((v for k, v in table.items() if k in name), 312e12)
        if dtype == torch.float32:
            peak = peak / 2 if "H1" in name or "H2" in name else peak / 16  # TF32 tensor-core peak
    else:
        n = 1024
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best, reps = float("inf"), 10
        for _ in range(3):  # best of three: a shared machine's load only ever slows a probe down
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = min(best, time.perf_counter() - start)
        peak = 2 * n ** 3 * reps / best
    _PEAK_CACHE[key] = peak
    return peak


def resolve_dtype(name, device):
    """'auto' -> bf16 where the device supports it, else fp32; reject bf16/fp16 where unsupported."""
    dev = torch.device(device).type
    bf16_ok = torch.cuda.is_bf16_supported() if dev == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if name == "auto":
        return torch.bfloat16 if bf16_ok else torch.float32
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise ConfigError(f"--dtype {name} is unknown; use auto, bfloat16, float16 or float32")
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(f"--dtype bfloat16 is not supported natively on this {dev} device; use --dtype float32 (or auto)")
    if name == "float16" and dev == "cpu":
        raise ConfigError("--dtype float16 is not supported for training on CPU; use --dtype float32 (or auto)")
    return table[name]
