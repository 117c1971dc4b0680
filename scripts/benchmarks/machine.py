"""The machine a benchmark ran on, in one line (bench, bench_loader and the JSON records they append)."""
import os
import platform

import torch


def machine_description(device):
    """CPU model, cores, load and memory (plus the GPU name on CUDA), in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [cpu, f"{os.cpu_count()} cores", f"torch threads {torch.get_num_threads()}"]
    if hasattr(os, "getloadavg"):
        parts.append("load %.1f/%.1f/%.1f" % os.getloadavg())
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        parts.append(f"{pages * page_size / 2**30:.0f} GiB RAM")
    except (ValueError, OSError):
        pass
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name(device))
    return ", ".join(parts)
