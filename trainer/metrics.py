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


# Dense (no sparsity) peak FLOP/s from NVIDIA's datasheets / architecture whitepapers, fp16/bf16 with fp32
# accumulate: (bf16 = fp16, tf32 tensor core, plain fp32). First matching name wins, so variants come first.
CUDA_PEAKS = (
    ("H100 PCIe", (756e12, 378e12, 51.2e12)),  # H100 PCIe datasheet: bf16 1513 sparse, tf32 756 sparse
    ("H100 NVL", (835e12, 417.5e12, 60e12)),  # H100 NVL datasheet: bf16 1671 sparse, tf32 835 sparse
    ("H100", (989.4e12, 494.7e12, 66.9e12)),  # H100 SXM5 datasheet: bf16 1979 sparse, tf32 989 sparse
    ("H200 NVL", (835e12, 417.5e12, 60e12)),  # H200 NVL datasheet: bf16 1671 sparse, tf32 835 sparse
    ("H200", (989.4e12, 494.7e12, 66.9e12)),  # H200 SXM datasheet: same GH100 compute as H100 SXM
    ("A100", (312e12, 156e12, 19.5e12)),  # A100 datasheet (SXM and PCIe)
    ("L40S", (362.05e12, 183e12, 91.6e12)),  # L40S datasheet: bf16 733 sparse, tf32 366 sparse
    ("L40", (181.05e12, 90.5e12, 90.5e12)),  # L40 datasheet: bf16 362 sparse, tf32 181 sparse
    ("RTX 4090", (165.2e12, 82.6e12, 82.6e12)),  # Ada whitepaper: fp16/bf16 w/ fp32 acc 165.2 (330.4 sparse)
    ("RTX 3090", (71e12, 35.6e12, 35.6e12)),  # Ampere GA102 whitepaper: fp16/bf16 w/ fp32 acc 71 (142 sparse)
)

_PEAK_CACHE = {}


def cuda_table_peak(name, dtype, tf32):
    """Dense peak FLOP/s of the named CUDA device for `dtype` (fp32 as TF32 when `tf32`); None if not listed."""
    half, tf32_peak, fp32 = next((v for k, v in CUDA_PEAKS if k in name), (None, None, None))
    if dtype in (torch.bfloat16, torch.float16):
        return half
    return tf32_peak if tf32 else fp32


def _sync(device):
    if device.type == "cuda":  # kernels run asynchronously: time them to completion
        torch.cuda.synchronize(device)


def _probe_peak(device, dtype):
    """FLOP/s of an n x n matmul, best of three (a shared machine's load only ever slows a probe down)."""
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    best, reps = float("inf"), 10
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 * reps / best


def peak_flops(device, dtype):
    """Device peak FLOP/s for `dtype`: a listed CUDA device from CUDA_PEAKS (fp32 counts TF32 when matmuls use
    it), anything else (CPU, unlisted GPUs) measured once by a matmul probe."""
    device = torch.device(device)
    tf32 = torch.get_float32_matmul_precision() != "highest"
    key = (str(device), dtype, tf32)
    if key not in _PEAK_CACHE:
        peak = cuda_table_peak(torch.cuda.get_device_name(device), dtype, tf32) if device.type == "cuda" else None
        _PEAK_CACHE[key] = peak or _probe_peak(device, dtype)
    return _PEAK_CACHE[key]


def enable_tf32(device, strict):
    """fp32 matmuls on CUDA in TF32 (10-bit mantissa inputs, fp32 accumulate) unless `strict`; CPU untouched."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("highest" if strict else "high")
        torch.backends.cudnn.allow_tf32 = not strict


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
