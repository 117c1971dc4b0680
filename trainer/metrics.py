"""What a step measures: FLOPs and peak FLOP/s (MFU), peak memory, tokens/s over a window. The collectives that sum
them over ranks are in trainer/launch.py; where the figures go (JSONL, TensorBoard, swanlab), trainer/tracking.py."""
import resource
import time

import torch


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


def peak_mem_gb(device):
    """Peak memory of this process: CUDA allocator peak, or the CPU process's max resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class StepTimer:
    """Tokens and FLOPs since the last logged step, for tokens/s and MFU over that window."""

    def __init__(self, peak_flops_total):
        self.peak, self.start_time = peak_flops_total, time.time()
        self.reset()

    def reset(self):
        self.window_start, self.tokens, self.flops = time.time(), 0, 0.0

    def add(self, tokens, flops):
        self.tokens += tokens
        self.flops += flops

    def rates(self):
        """(tokens/s, MFU, seconds since the run started) of the window; starts the next window."""
        elapsed = max(time.time() - self.window_start, 1e-9)
        rates = self.tokens / elapsed, self.flops / elapsed / self.peak, time.time() - self.start_time
        self.reset()
        return rates
