"""Named GPUs for the planner (`scripts/bench.py --plan --gpu NAME`, scripts/planner/fit.py): dense bf16 peak FLOP/s
(tensor cores, fp32 accumulate, no sparsity), memory and memory bandwidth, each row with the datasheet it comes from;
a card not listed is described by its memory and peak (described_card)."""
import re

GIB = 2 ** 30

# name: (dense bf16 FLOP/s, memory bytes, bandwidth bytes/s, source). The datasheets give sparse figures for
# Ampere and later data-center parts: dense is half of them. Consumer Ada/Ampere: bf16 with fp32 accumulate (the
# GeForce rate is half of the fp16-accumulate one). NVIDIA's GeForce pages give one sparse figure ("AI TOPS"): Ampere's
# is fp16 with fp16 accumulate, so bf16 dense with fp32 accumulate is a quarter of it (3090: 285 -> 71, the GA102
# whitepaper's); Ada's is fp8, an eighth (4090: 1321 -> 165.2, the Ada whitepaper's).
GPUS = {
    "T4": (65e12, 16 * GIB, 320e9, "NVIDIA T4 datasheet: fp16 tensor 65 TFLOPS (no bf16: fp16), 16 GB, 320 GB/s"),
    "L4": (121e12, 24 * GIB, 300e9, "NVIDIA L4 datasheet: bf16 242 TFLOPS sparse, 24 GB, 300 GB/s"),
    "3060": (25.3e12, 12 * GIB, 360e9, "NVIDIA GeForce RTX 3060 spec: 101 AI TOPS (fp16 sparse) / 4, 12 GB, 360 GB/s"),
    "3060Ti": (32.5e12, 8 * GIB, 448e9, "NVIDIA GeForce RTX 3060 Ti spec: 130 AI TOPS (fp16 sparse) / 4, 8 GB, "
               "448 GB/s"),
    "3070": (40.6e12, 8 * GIB, 448e9, "NVIDIA Ampere GA102 whitepaper (GA104): bf16 w/ fp32 acc 40.6 TFLOPS, 8 GB, "
             "448 GB/s"),
    "3080": (59.5e12, 10 * GIB, 760e9, "NVIDIA Ampere GA102 whitepaper: bf16 w/ fp32 acc 59.5 TFLOPS, 10 GB, 760 GB/s"),
    "3090": (71e12, 24 * GIB, 936e9, "NVIDIA Ampere GA102 whitepaper: bf16 w/ fp32 acc 71 TFLOPS, 24 GB, 936 GB/s"),
    "4060": (30.2e12, 8 * GIB, 272e9, "NVIDIA GeForce RTX 4060 spec: 242 AI TOPS (fp8 sparse) / 8, 8 GB, 272 GB/s"),
    "4060Ti": (44.1e12, 8 * GIB, 288e9, "NVIDIA GeForce RTX 4060 Ti spec: 353 AI TOPS (fp8 sparse) / 8, 8 GB, "
               "288 GB/s"),
    "4060Ti-16": (44.1e12, 16 * GIB, 288e9, "NVIDIA GeForce RTX 4060 Ti spec (16 GB): 353 AI TOPS (fp8 sparse) / 8, "
                  "16 GB, 288 GB/s"),
    "4070": (58.3e12, 12 * GIB, 504e9, "NVIDIA GeForce RTX 4070 spec: 466 AI TOPS (fp8 sparse) / 8, 12 GB, 504 GB/s"),
    "4070Ti": (80.2e12, 12 * GIB, 504e9, "NVIDIA Ada whitepaper (as RTX 4080 12GB): bf16 w/ fp32 acc 80.2 TFLOPS, "
               "12 GB, 504 GB/s"),
    "4080": (97.5e12, 16 * GIB, 717e9, "NVIDIA Ada whitepaper: bf16 w/ fp32 acc 97.5 TFLOPS, 16 GB, 717 GB/s"),
    "4090": (165.2e12, 24 * GIB, 1008e9, "NVIDIA Ada whitepaper: bf16 w/ fp32 acc 165.2 TFLOPS, 24 GB, 1008 GB/s"),
    "A10": (125e12, 24 * GIB, 600e9, "NVIDIA A10 datasheet: bf16 250 TFLOPS sparse, 24 GB, 600 GB/s"),
    "L40S": (362.05e12, 48 * GIB, 864e9, "NVIDIA L40S datasheet: bf16 733 TFLOPS sparse, 48 GB, 864 GB/s"),
    "A100-40": (312e12, 40 * GIB, 1555e9, "NVIDIA A100 datasheet: bf16 312 TFLOPS, 40 GB HBM2, 1555 GB/s"),
    "A100-80": (312e12, 80 * GIB, 2039e9, "NVIDIA A100 datasheet: bf16 312 TFLOPS, 80 GB HBM2e, 2039 GB/s (SXM)"),
    "H100": (989.4e12, 80 * GIB, 3.35e12, "NVIDIA H100 datasheet (SXM5): bf16 1979 TFLOPS sparse, 80 GB, 3.35 TB/s"),
    "H100-PCIe": (756e12, 80 * GIB, 2e12, "NVIDIA H100 datasheet (PCIe): bf16 1513 TFLOPS sparse, 80 GB, 2 TB/s"),
    "H200": (989.4e12, 141 * GIB, 4.8e12, "NVIDIA H200 datasheet (SXM): bf16 1979 TFLOPS sparse, 141 GB, 4.8 TB/s"),
}
# Cards without bf16 tensor cores: torch emulates bf16 there (torch.cuda.is_bf16_supported() says True, so the trainer's
# --dtype auto takes bf16, far below the row's peak, which is the card's fp16 one)
NO_BF16 = {"T4": "Turing, sm75: fp16 tensor cores only"}
ALIASES = {"A100": "A100-80", "A100-40GB": "A100-40", "A100-80GB": "A100-80", "RTX4090": "4090", "RTX3090": "3090",
           "RTX 4090": "4090", "RTX 3090": "3090", "H100-SXM": "H100"}


def plain(name):
    """A card's name as matched: lower case without spaces, dashes, underscores, "GeForce", "RTX" or a trailing "GB"."""
    return re.sub(r"gb$", "", re.sub(r"[\s_-]|geforce|rtx", "", name.lower()))


def find_gpu(name):
    """(name, row) of a named GPU, case-insensitive ("RTX 4060 Ti", "a100-80gb"), aliases allowed; ValueError naming
    the known ones. A (name, row) pair already found or described (described_card) is returned as it is."""
    if isinstance(name, tuple):
        return name
    wanted = {plain(alias): key for alias, key in ALIASES.items()}.get(plain(name), name)
    for key, row in GPUS.items():
        if plain(key) == plain(wanted):
            return key, row
    raise ValueError(f"--gpu {name}: not in the table; known: {', '.join(GPUS)} (scripts/planner/gpus.py); an "
                     "unlisted card: --gpu_memory_gib and --gpu_tflops")


def described_card(memory_gib, tflops, bandwidth_gbs=None):
    """(name, row) of a card not in the table from its memory (GiB), dense bf16 peak (TFLOP/s) and, when given, its
    memory bandwidth (GB/s; NaN when not: RL's decoding time is then not estimated)."""
    bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs else float("nan")
    return (f"card of {memory_gib:g} GiB, {tflops:g} TFLOP/s",
            (tflops * 1e12, memory_gib * GIB, bandwidth, "described by --gpu_memory_gib and --gpu_tflops"))
