"""The flags of the GPU plan (scripts/fit_plan.py, `scripts/bench.py --plan --gpu NAME`) and their checks, on argparse
and the GPU table only: a bad one is one `error:` line (the flag, its value, what it takes) and exit 2 in well under a
second, before torch and the trainer load (scripts/planner/fit.py plans with them)."""
import argparse
import math

from scripts.planner.gpus import GPUS, described_card, find_gpu

STAGES = ("pretrain", "sft", "lora", "dpo", "kto", "reward", "distillation", "gkd", "grpo", "ppo", "agent")
CARD_FLAGS = ("--gpu_memory_gib", "--gpu_tflops")  # an unlisted card, described by both
# flag: (the check a value passes, what the flag takes), for the numbers given
NUMBERS = {"nproc": (lambda v: v >= 1, "a whole number of GPUs, 1 or more"),
           "mfu": (lambda v: 0 < v <= 1, "a share of the card's peak in (0, 1], e.g. 0.3 (your run's records' mfu)"),
           "usd_per_hour": (lambda v: v >= 0, "the price of one GPU hour in dollars, 0 or more"),
           "corpus_tokens": (lambda v: v >= 1, "the corpus's token count, 1 or more, e.g. 1e9"),
           "gpu_memory_gib": (lambda v: v > 0, "the card's memory in GiB, more than 0, e.g. 8"),
           "gpu_tflops": (lambda v: v > 0, "the card's dense bf16 tensor peak in TFLOP/s, more than 0, e.g. 40"),
           "gpu_bandwidth_gbs": (lambda v: v > 0, "the card's memory bandwidth in GB/s, more than 0, e.g. 448"),
           "teacher_hidden_size": (lambda v: v >= 1, "a width, 1 or more"),
           "teacher_num_hidden_layers": (lambda v: v >= 1, "a number of layers, 1 or more"),
           "teacher_use_moe": (lambda v: v in (0, 1), "0 or 1")}


class OneLineParser(argparse.ArgumentParser):
    """argparse's complaint in one `error:` line, exit 2 (not the usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}; --help lists the flags\n")


def parser():
    """The plan's own flags; the others are the trainer's (the stage's script reads them)."""
    p = OneLineParser(description=__doc__, allow_abbrev=False)
    a = p.add_argument
    a("--gpu", default=None, help="a named GPU: " + ", ".join(GPUS) + " (scripts/planner/gpus.py); or describe one "
      "not listed with --gpu_memory_gib and --gpu_tflops")
    a("--gpu_memory_gib", type=float, default=None, help="an unlisted card's memory (GiB), with --gpu_tflops")
    a("--gpu_tflops", type=float, default=None, help="an unlisted card's dense bf16 tensor peak (TFLOP/s, fp32 "
      "accumulate, no sparsity: scripts/planner/gpus.py says how a GeForce spec's AI TOPS gives it), with "
      "--gpu_memory_gib")
    a("--gpu_bandwidth_gbs", type=float, default=None, help="an unlisted card's memory bandwidth (GB/s): RL's decoding "
      "time per step")
    a("--stage", default="pretrain", choices=STAGES, help="the trainer/train_<stage>.py planned")
    a("--nproc", type=int, default=1, help="GPUs (the layout flags split the model over them)")
    a("--mfu", type=float, default=None, help="model FLOPs utilisation for the epoch time (default: scripts/planner/"
      "fit.py's DEFAULT_MFU, dense, or DEFAULT_MFU_MOE; the plan prints the one taken)")
    a("--usd_per_hour", type=float, default=None, help="price of one GPU hour, for the cost")
    a("--corpus_tokens", type=float, default=None, help="the corpus's tokens, for a corpus not at hand (default: "
      "counted from --data_path or the stage's demo data)")
    teacher = "distillation/GKD: the {} of a teacher not at hand yet (default: the student's; use_moe 1, MiniMind's)"
    a("--teacher_hidden_size", type=int, default=None, help=teacher.format("hidden_size"))
    a("--teacher_num_hidden_layers", type=int, default=None, help=teacher.format("num_hidden_layers"))
    a("--teacher_use_moe", type=int, default=None, help=teacher.format("use_moe"))
    a("--json", action="store_true", help="print the plan as JSON")
    return p


def parse_args(argv):
    """(the plan's flags, the trainer's flags) from `argv`, checked; one `error:` line and exit 2 on a bad one.
    args.card: the GPU's (name, row) from the table or described by --gpu_memory_gib and --gpu_tflops."""
    p = parser()
    args, rest = p.parse_known_args(argv)
    for name, (fits, takes) in NUMBERS.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and fits(value)):
            p.exit(2, f"error: --{name} {value:g}: takes {takes}\n")
    described = [flag for flag in CARD_FLAGS if getattr(args, flag[2:]) is not None]
    if args.gpu is not None and described:
        p.exit(2, f"error: --gpu {args.gpu} with {' and '.join(described)}: name a card or describe one, not both\n")
    if len(described) == 1:
        missing = next(flag for flag in CARD_FLAGS if flag not in described)
        p.exit(2, f"error: {described[0]} {getattr(args, described[0][2:]):g} without {missing}: an unlisted card "
                  "takes both, its memory (GiB) and its dense bf16 peak (TFLOP/s)\n")
    if args.gpu_bandwidth_gbs is not None and not described:
        p.exit(2, f"error: --gpu_bandwidth_gbs {args.gpu_bandwidth_gbs:g} without --gpu_memory_gib and --gpu_tflops: "
                  "it describes an unlisted card (a named one's is in the table)\n")
    if args.gpu is None and not described:
        p.exit(2, "error: which GPU? --gpu NAME (" + ", ".join(GPUS) + ") or an unlisted card's --gpu_memory_gib and "
                  "--gpu_tflops\n")
    try:
        args.card = find_gpu(args.gpu) if args.gpu is not None else described_card(
            args.gpu_memory_gib, args.gpu_tflops, args.gpu_bandwidth_gbs)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    return args, rest


def plans_a_gpu(argv):
    """Whether scripts/bench.py's `argv` asks for a GPU plan: --plan with --gpu or an unlisted card's flags."""
    names = {arg.split("=", 1)[0] for arg in argv}
    return "--plan" in names and bool(names & {"--gpu", *CARD_FLAGS})
