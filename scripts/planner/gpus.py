"""Named GPUs for the planner (`scripts/bench.py --plan --gpu NAME`, scripts/planner/fit.py): dense bf16 peak FLOP/s
(tensor cores, fp32 accumulate, no sparsity), memory and memory bandwidth, each row with the datasheet it comes from."""

GIB = 2 ** 30

# name: (dense bf16 FLOP/s, memory bytes, bandwidth bytes/s, source). The datasheets give sparse figures for
# Ampere and later data-center parts: dense is half of them. Consumer Ada/Ampere: bf16 with fp32 accumulate (the
# GeForce rate is half of the fp16-accumulate one).
GPUS = {
    "T4": (65e12, 16 * GIB, 320e9, "NVIDIA T4 datasheet: fp16 tensor 65 TFLOPS (no bf16: fp16), 16 GB, 320 GB/s"),
    "L4": (121e12, 24 * GIB, 300e9, "NVIDIA L4 datasheet: bf16 242 TFLOPS sparse, 24 GB, 300 GB/s"),
    "3090": (71e12, 24 * GIB, 936e9, "NVIDIA Ampere GA102 whitepaper: bf16 w/ fp32 acc 71 TFLOPS, 24 GB, 936 GB/s"),
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


def find_gpu(name):
    """(name, row) of a named GPU, case-insensitive, aliases allowed; ValueError naming the known ones."""
    wanted = ALIASES.get(name.upper(), ALIASES.get(name, name))
    for key, row in GPUS.items():
        if key.lower() == wanted.lower():
            return key, row
    raise ValueError(f"--gpu {name}: not in the table; known: {', '.join(GPUS)} (scripts/planner/gpus.py)")
