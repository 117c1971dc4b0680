"""What a step measures: FLOPs and peak FLOP/s (MFU), peak memory, tokens/s over a window. The collectives that sum
them over ranks are in trainer/base/launch.py; where the figures go (JSONL, TensorBoard, swanlab),
trainer/observe/tracking.py."""
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import resource
import time
from contextlib import contextmanager

import torch

from model.atomic import atomic_write  # the one atomic writer (temporary file, fsync, rename)
from model.torch_compat import cpu_bf16_native


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


def matmul_rate(device, dtype, shape, trials=3, cast_from=None, seconds=0.0):
    """FLOP/s of an (m, k) @ (k, n) matmul in `dtype`, the best of `trials` and of as many more as fit in `seconds`
    (load on a shared machine only slows a trial down; a longer window catches a quiet moment). cast_from: the inputs
    live in that dtype and are cast first, as autocast does with fp32 activations."""
    m, k, n = shape
    a, b = (torch.randn(rows, cols, dtype=cast_from or dtype, device=device) for rows, cols in ((m, k), (k, n)))
    run = (lambda: a.to(dtype) @ b.to(dtype)) if cast_from is not None else (lambda: a @ b)
    run()  # warm-up: the kernel's first call picks and prepares its code path
    best, count, deadline = float("inf"), 0, time.perf_counter() + seconds
    while count < trials or (time.perf_counter() < deadline and count < 100):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        best, count = min(best, time.perf_counter() - start), count + 1
    return 2 * m * k * n / best


# A training matmul: 2048 token rows through the default model's MLP (hidden 768 -> 2432): 7.6 GFLOP, ~40 ms in fp32
# on 2 cores; larger squares and the lm_head's shape run no faster on the CPUs measured (1 thread, EPYC: 110-117 fp32)
TRAINING_SHAPE = (2048, 768, 2432)
TRIALS, WINDOW_S = 5, 0.3  # at least 5 trials over 0.3 s, the best counts: slowed-down trials are dropped
# quiet measurements only (cpu_matmul_rates.json held busy ones too, in a format this version does not trust)
RATES_FILE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minimind4d",
                          "cpu_matmul_quiet_rates.json")
LOCK_WAIT_S = 60  # a process measuring the rates holds a lock this long at most; others wait for its result


def cpu_name():
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


QUIET_SHARE = 0.85  # a measurement is quiet when its threads held the cores this share of its wall time
RETRY_S = 300  # a provisional peak is measured again at a log step this long after the last try, at the earliest


def measure_cpu_rates(own_threads=0):
    """{name: FLOP/s} with this process's threads at TRAINING_SHAPE: fp32, and where native bf16 and
    "bfloat16_autocast" (bf16 with its inputs cast from fp32 first, as autocast runs it); "quiet": this process's
    threads got the cores (CPU time >= QUIET_SHARE x wall time x threads), the load average shows no other work
    (cores_free_of_others: work on a core's SMT sibling slows a matmul without taking its CPU time) and, where the
    kernel says (Linux), no other work ran during the measurement itself (others_were_idle: the load average lags a
    minute behind work that has just started)."""
    busy_before = cpu_busy_seconds()
    device, wall, cpu = torch.device("cpu"), time.perf_counter(), time.process_time()
    rates = {"float32": matmul_rate(device, torch.float32, TRAINING_SHAPE, TRIALS, seconds=WINDOW_S)}
    if cpu_bf16_native():
        rates["bfloat16"] = matmul_rate(device, torch.bfloat16, TRAINING_SHAPE, TRIALS, seconds=WINDOW_S)
        rates["bfloat16_autocast"] = matmul_rate(device, torch.bfloat16, TRAINING_SHAPE, TRIALS,
                                                 cast_from=torch.float32, seconds=WINDOW_S)
    own, elapsed = time.process_time() - cpu, time.perf_counter() - wall
    share = own / (elapsed * torch.get_num_threads())
    return dict(rates, quiet=share >= QUIET_SHARE and cores_free_of_others(own_threads)
                and others_were_idle(busy_before, own, elapsed))


OTHERS_SHARE = 0.2  # other work during a measurement: at most this share of one core's time (background noise)


def cpu_busy_seconds():
    """Every core's busy time since boot, in seconds (Linux /proc/stat: all states but idle and iowait; steal counts,
    it is time the hypervisor gave our cores to someone else), or None where the kernel has no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def others_were_idle(busy_before, own_seconds, elapsed):
    """Whether the cores' busy time over a measurement of `elapsed` seconds was this process's own CPU time, give or
    take OTHERS_SHARE of one core; True where cpu_busy_seconds is unknown (the load average decides alone there)."""
    busy_after = cpu_busy_seconds()
    if busy_before is None or busy_after is None:
        return True
    return busy_after - busy_before - own_seconds <= OTHERS_SHARE * elapsed


def cpu_rates_key():
    """What the rates depend on: the CPU model, torch's version (its kernels) and the threads a process uses."""
    return f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def cores_free_of_others(own_threads=0):
    """The 1-minute load average shows no work but this process's threads' (`own_threads` of them in it when this
    process has been training): at most cores - threads + own_threads + 0.5."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return os.getloadavg()[0] <= cores - torch.get_num_threads() + own_threads + 0.5


def cpu_matmul_rates(retry=False):
    """This machine's matmul rates (measure_cpu_rates) and "provisional": a quiet measurement is cached in RATES_FILE
    per cpu_rates_key and is the peak; without one, a measurement now, kept in this process only and provisional
    (a busy machine's rates are low, so an MFU against them is high). retry: measure a provisional one again when
    RETRY_S have passed and the cores look free."""
    key, own_threads = cpu_rates_key(), torch.get_num_threads() if retry else 0  # retry: training until now
    entry = _PEAK_CACHE.get(key)
    if entry is None or (retry and entry["provisional"] and time.monotonic() >= entry["retry_at"]
                         and cores_free_of_others(own_threads)):
        saved = _read_json(RATES_FILE).get(key)
        _PEAK_CACHE[key] = dict(saved, provisional=False) if _is_quiet(saved) else \
            _measure_locked(RATES_FILE, key, own_threads)
    return _PEAK_CACHE[key]


def _is_quiet(entry):
    return isinstance(entry, dict) and entry.get("quiet") is True  # entries of older versions are measured again


def _measure_locked(path, key, own_threads):
    """Measure, and cache a quiet measurement, one process at a time (a lock file): a process that waited for the lock
    takes a quiet entry the other wrote, so the ranks of a node read the same numbers."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock, deadline = path + ".lock", time.time() + LOCK_WAIT_S
    while True:
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            if time.time() > deadline:  # its holder died while measuring
                _remove(lock)
            time.sleep(0.2)
    try:
        entry = _read_json(path).get(key)
        if _is_quiet(entry):  # measured by the process that held the lock
            return dict(entry, provisional=False)
        entry = measure_cpu_rates(own_threads)
        if not entry["quiet"]:
            return dict(entry, provisional=True, retry_at=time.monotonic() + RETRY_S)
        rates = dict(_read_json(path), **{key: entry})
        atomic_write(path, lambda f: f.write(json.dumps(rates, indent=1, sort_keys=True).encode()))
        return dict(entry, provisional=False)
    finally:
        _remove(lock)


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:  # another waiter took over the same stale lock
        pass


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}


def peak_flops(device, dtype):
    """Device peak FLOP/s for `dtype`: a listed CUDA device from CUDA_PEAKS (fp32 counts TF32 when matmuls use
    it); a CPU's matmul rate measured on quiet cores (cpu_matmul_rates; provisional until one was); an unlisted GPU
    measured once by a matmul."""
    return peak_and_status(device, dtype)[0]


def peak_and_status(device, dtype, retry=False):
    """(peak FLOP/s, provisional): provisional where a CPU's cores were busy at every measurement so far; retry: give
    a provisional CPU peak another measurement when one is due (cpu_matmul_rates)."""
    device = torch.device(device)
    if device.type == "cpu":
        rates = cpu_matmul_rates(retry)
        return rates["bfloat16" if dtype == torch.bfloat16 and "bfloat16" in rates else "float32"], rates["provisional"]
    tf32 = torch.get_float32_matmul_precision() != "highest"
    key = (str(device), dtype, tf32)
    if key not in _PEAK_CACHE:
        peak = cuda_table_peak(torch.cuda.get_device_name(device), dtype, tf32)
        _PEAK_CACHE[key] = peak or matmul_rate(device, dtype, (4096, 4096, 4096), trials=5)
    return _PEAK_CACHE[key], False


def enable_tf32(device, strict):
    """fp32 matmuls on CUDA in TF32 (10-bit mantissa inputs, fp32 accumulate) unless `strict`; CPU untouched."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("highest" if strict else "high")
        torch.backends.cudnn.allow_tf32 = not strict


LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None
TRIM_SHARE = 0.01  # of the run's time at most spent in malloc_trim
TRIM_GROWTH = 1.1  # trim once the resident set is this much above its level after the last trim (or the first step)
_trim = {"next": 0.0, "level": None}


def resident_bytes():
    """This process's resident set now (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap(device):
    """CPU under glibc: give the heap's free pages back to the system (malloc_trim) once the resident set has grown
    by TRIM_GROWTH since the last trim (the first call sets the level), at most TRIM_SHARE of the time.

    SFT and distillation allocate tensors sized by each batch's target tokens; glibc keeps the freed pieces in its
    heap, so the resident set climbed with every step (SFT h256 on 2 cores: 1.08 -> 1.53 GB in 30 steps, flat at
    0.5-1.0 GB when every large block is mmap-ed and given back, 1.08 -> 1.18 GB with a trim after each step). A trim
    after every step cost more than its own time: the pages it gave back faulted in again in the next step (DPO h256
    bf16 on 1 thread: 3,500 page faults and ~10 ms of system time a 50 ms step)."""
    if torch.device(device).type != "cpu" or not hasattr(LIBC, "malloc_trim") or time.monotonic() < _trim["next"]:
        return
    resident = resident_bytes()
    if _trim["level"] is None:
        _trim["level"] = resident
    if resident < _trim["level"] * TRIM_GROWTH:
        return
    start = time.monotonic()
    LIBC.malloc_trim(0)
    _trim["next"] = start + (time.monotonic() - start) / TRIM_SHARE
    _trim["level"] = max(_trim["level"], resident_bytes())  # memory the run holds stays: no trim after every step


@contextmanager
def start_up_frozen():
    """The training loop's context: the objects start-up made (datasets, tokenizer, modules: ~380,000 for a DPO run)
    leave the garbage collector's view (gc.freeze, after a collection clears the cycles among them) and come back
    when it ends. Each full collection walked them all: 0.23 s about every 100 steps of the DPO bench's run, 5% of
    its time. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def peak_mem_gb(device):
    """Peak memory of this process: CUDA allocator peak, or the CPU process's max resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def step_flops_of(trainer, micro_batches, target_tokens):
    """The FLOPs MFU counts for one optimizer step of `micro_batches` (the objective's, over every dp rank's rows at
    their width: --max_seq_len, or this rank's mean width where the rows are cut to the longest)."""
    plan = trainer.plan
    rows = plan.micro_batch_shape[0] * plan.data.num_microbatches * plan.layout.dp  # a DPO sample is two rows
    seq_len = plan.data.seq_len if plan.row_multiple is None else (
        sum(batch[0].shape[-1] for batch in micro_batches) / len(micro_batches))
    return trainer.objective.flops(trainer.config, seq_len, rows * seq_len, target_tokens, plan.model.chunked_loss)


def step_timer(device, dtype, world_size, clock=time.time):
    """The loop's StepTimer: MFU against the device's peak x world_size; a provisional CPU peak is measured again at
    log steps (peak_and_status retry) until a quiet measurement replaces it. clock: as StepTimer's."""
    def peak_total():
        peak, provisional = peak_and_status(device, dtype, retry=True)
        return peak * world_size, provisional
    return StepTimer(*peak_total(), remeasure=peak_total, clock=clock)


class StepTimer:
    """Tokens and FLOPs since the last logged step, for tokens/s and MFU over that window. provisional: the peak came
    from busy cores (the MFU reads high); remeasure() -> (peak, provisional) runs after each window while it is.
    clock: the time source (a test passes its own)."""

    def __init__(self, peak_flops_total, provisional=False, remeasure=None, clock=time.time):
        self.peak, self.provisional, self.remeasure, self.clock = peak_flops_total, provisional, remeasure, clock
        self.start_time, self.mfu_provisional = clock(), provisional
        self.reset()

    def reset(self):
        self.window_start, self.tokens, self.flops = self.clock(), 0, 0.0

    def add(self, tokens, flops):
        self.tokens += tokens
        self.flops += flops

    def window_tokens_per_sec(self):
        """tokens/s of the window so far, without starting the next: the bar's, so that at a log step it shows the
        record's number (the same window: the steps since the last record, their logging and saving included)."""
        return self.tokens / max(self.clock() - self.window_start, 1e-9)

    def rates(self):
        """(tokens/s, MFU, seconds since the run started) of the window; starts the next window (after a due
        measurement of a provisional peak, so its time counts in no window); mfu_provisional: that MFU's peak was."""
        now = self.clock()
        elapsed = max(now - self.window_start, 1e-9)
        rates = self.tokens / elapsed, self.flops / elapsed / self.peak, now - self.start_time
        self.mfu_provisional = self.provisional
        if self.provisional and self.remeasure is not None:
            self.peak, self.provisional = self.remeasure()
        self.reset()
        return rates
