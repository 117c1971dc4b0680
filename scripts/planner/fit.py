"""Will a run fit a GPU, how long is an epoch, what to change: the library of `scripts/bench.py --plan --gpu NAME`
and scripts/fit_plan.py (their flags and checks: scripts/planner/flags.py).

    python scripts/bench.py --plan --gpu 4090 --stage pretrain --hidden_size 768 --num_hidden_layers 16
    python scripts/fit_plan.py --gpu H100 --stage grpo --data_path prompts.jsonl --usd_per_hour 2.5

The memory per device by part: weights, gradients, optimizer state (fp32 master weights, fp32 gradients, two fp32
AdamW moments: what the trainer keeps), activations at the micro-batch and length in the GPU's dtype (bf16 autocast,
2 bytes, unless --dtype says otherwise: never what --dtype auto picks on the planning machine's CPU; scripts/planner/
cost.py's saved tensors, times ACTIVATION_OVERHEAD for autograd's backward temporaries, measured), and the models
beside the policy: RL's frozen reference, a distillation/GKD teacher (its own size: from its file, or --teacher_* when
not at hand), PPO's value head, a reward model (sized by its folder's config), the rollouts' KV cache (DPO/KTO drop
their reference before training); the cheapest change that makes it fit; the corpus's tokens (the trainer's token
cache of --data_path when there is one, else a sample of its lines tokenized, scaled by bytes) and the time per epoch
at the card's dense bf16 peak x MFU. The estimate is of tensors (torch.cuda.max_memory_allocated on a GPU); a run fits
when it fits the card less the CUDA context and the allocator's slack (CUDA_CONTEXT_GIB, ALLOCATOR_SLACK).
tests/test_fit_plan.py checks the memory against measured peaks (dense, MoE, GRPO, distillation) and the FLOPs
against a hand count.
"""
import argparse
import importlib
import json
import math
import os
import sys
import tempfile

import torch

from dataset.shards import cache_dir_for
from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from model.weights.shapes import config_fields
from scripts.planner.cost import divisor, layout_sizes, plan_layout, routed_expert_params
from scripts.planner.flags import STAGES, parse_args
from scripts.planner.gpus import GIB, NO_BF16, find_gpu
from trainer.observe.metrics import model_flops_per_token
from trainer.plan.flags import add_train_args
from trainer.plan.model_config import build_config
from trainer.plan.resolve import resolve
from trainer.plan.stage import Stage

# Saved activations x this = the activation peak: autograd's backward temporaries (each layer's input gradients
# beside the saved tensors). Measured on CPU as the most tensor bytes alive at once (tests/helpers/memory_entry.py:
# torch's profiler over the allocator, what torch.cuda.max_memory_allocated reports on a GPU; the same on every run):
# h256 L4 batch 8 x 256 fp32 dense, 0.3566 GiB against 0.0743 GiB of states + 0.2520 GiB of saved tensors -> 1.12;
# tests/test_fit_plan.py checks it on a MoE (with its experts' stacked weights, scripts/planner/cost.py
# expert_weight_copies), a GRPO and a distillation run.
ACTIVATION_OVERHEAD = 1.12
# A card holds less than its memory for tensors: the CUDA context with cuBLAS and NCCL workspaces (0.3-1 GiB by card
# and driver) and the caching allocator's fragmentation (blocks reserved, not allocated; PyTorch's CUDA notes: set
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to lower it). A run fits when its tensors x (1 + ALLOCATOR_SLACK) +
# CUDA_CONTEXT_GIB fit the card: allowances, stated, not measured here.
CUDA_CONTEXT_GIB, ALLOCATOR_SLACK = 1.0, 0.10
# Model FLOPs utilisation assumed for the epoch time. MiniMind-size models (26-104M, hidden 512-768) are too narrow to
# fill a data-center GPU's tensor cores: nanoGPT's 124M reaches about 0.3-0.4 of an A100 with torch.compile and flash
# attention; we take 0.3 dense and 0.2 MoE (the router and the per-expert gathers: docs/performance.md's MoE/dense
# step-time row). Give --mfu the MFU your own run logs (its records' `mfu`) to replace it.
DEFAULT_MFU, DEFAULT_MFU_MOE = 0.3, 0.2
SAMPLE_LINES = 2000  # lines of the corpus tokenized to count its tokens
DTYPES = ("auto", "bfloat16", "float16", "float32")  # the trainer's --dtype values


# a registry: each --stage's entry script, imported by its name when that stage is planned (tests/test_house.py checks
# every entry names a module)
ENTRY_SCRIPTS = {stage: f"trainer.train_{stage}" for stage in STAGES}


class Captured(Exception):
    """The stage class and script defaults an entry script passes to parse_args (raised in place of parsing)."""


def script_stage(name):
    """(Stage class, the script's defaults) of trainer/train_<name>.py, read from its own parse_args call."""
    module = importlib.import_module(ENTRY_SCRIPTS[name])

    def capture(description, stage, **defaults):
        raise Captured(stage, defaults)
    real, module.parse_args = module.parse_args, capture
    try:
        module.main()
    except Captured as c:
        return c.args
    finally:
        module.parse_args = real
    raise RuntimeError(f"trainer/train_{name}.py did not call parse_args")


def planned_dtype(name, gpu=None):
    """(dtype, note): what a GPU run with --dtype `name` trains in, whatever CPU plans it: as given; auto: bfloat16
    autocast (the trainer's auto on CUDA, torch.cuda.is_bf16_supported: every listed card, emulated on gpus.NO_BF16's);
    note: what to pass where `gpu` has no bf16 unit, else ''."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name} is unknown; use auto, bfloat16, float16 or float32")
    dtype = "bfloat16" if name == "auto" else name
    if dtype == "bfloat16" and gpu in NO_BF16:
        return dtype, (f"dtype: the {gpu} has no bf16 tensor cores ({NO_BF16[gpu]}): bfloat16 runs emulated, far below "
                       "the peak taken here; pass --dtype float16 to train on its fp16 tensor cores")
    return dtype, ""


def dtype_bytes(dtype):
    """Bytes per activation element: 4 in float32, 2 under bf16/fp16 autocast (weights and states stay fp32)."""
    return 4 if dtype == "float32" else 2


def resolve_for_gpu(run, nproc, stage=Stage):
    """resolve() as the trainer would on `nproc` processes, its checks run on this machine in float32 (every CPU runs
    it): the planned GPU's dtype (planned_dtype of run.dtype) enters the estimate through dtype_bytes, so the
    planning CPU's bf16 probe and rates never do."""
    given, run.dtype = run.dtype, "float32"
    try:
        return resolve(run, nproc, 0, stage)
    finally:
        run.dtype = given


def stage_plan(stage_name, argv, nproc, teacher=None):
    """The TrainPlan the stage's script would run with `argv` on `nproc` processes (weights are not read; the dtype:
    resolve_for_gpu), and the parsed flags. A distillation/GKD teacher not at hand is planned from a stand-in of its
    shapes (stand_in_teacher)."""
    stage, defaults = script_stage(stage_name)
    parser = add_train_args(argparse.ArgumentParser(allow_abbrev=False), stage, **dict(defaults, from_weight="none"))
    run = parser.parse_args(argv)
    planned_dtype(run.dtype)  # an unknown name: one line, before anything else
    reward_model = getattr(run, "reward_model", None)
    if reward_model:
        run.reward_model = None  # the folder need not exist here: reward_model_params sizes it when it does
    try:
        plan = resolve_for_gpu(run, nproc, stage)
    except ConfigError as e:
        if not (hasattr(run, "teacher_weight") and str(e).startswith("--teacher_weight:") and "not exist" in str(e)):
            raise
        with tempfile.TemporaryDirectory() as folder:
            run.teacher_weight = stand_in_teacher(build_config(run), teacher or {}, folder)
            plan = resolve_for_gpu(run, nproc, stage)
        run.teacher_weight = None  # planned from its shapes, not a file
    run.reward_model = reward_model
    return plan, run


def stand_in_teacher(student, teacher, folder):
    """A weights file holding the teacher's shapes only (meta tensors: no values, a few KB), read by the trainer's own
    teacher checks. The teacher: MiniMind's default (the student's width and depth, MoE) with `teacher`'s fields."""
    fields = dict(config_fields(student.to_dict()), use_moe=True)
    given = {k: v for k, v in teacher.items() if v is not None}
    if given.get("hidden_size", student.hidden_size) != student.hidden_size:  # sizes derived from the width: again
        for name in ("head_dim", "intermediate_size", "moe_intermediate_size"):
            fields.pop(name)
    fields.update(given)
    config = MiniMindConfig(**{k: v for k, v in fields.items() if k != "loss_chunk_size"})
    with torch.device("meta"):
        state_dict = MiniMindForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")  # one tensor under two names; the reader restores the twin
    path = os.path.join(folder, "teacher.pth")
    save_weights_file(state_dict, config, path)
    return path


def model_params(config):
    """Parameters of a MiniMind config (a teacher), counted on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in MiniMindForCausalLM(config).parameters())


def reward_model_params(path):
    """Parameters of a Hugging Face sequence classifier from its folder's config (meta device), or None where the
    folder is not at hand."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig, AutoModelForSequenceClassification  # only a plan with --reward_model
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def memory_parts(plan, config, run, act_bytes=None):
    """Bytes per device by part, and the layout model's estimate they come from; act_bytes: bytes per activation
    element (default: the planned GPU dtype's, dtype_bytes); est["notes"]: how the extra models were counted."""
    lay, data, stage = plan.layout, plan.data, plan.stage
    rows, length = plan.micro_batch_shape  # a row's tokens on one rank: the sequence over the dimensions cutting it
    act_bytes = act_bytes or dtype_bytes(planned_dtype(run.dtype)[0])
    est = plan_layout(config, length * divisor(layout_sizes(lay), "tokens"), rows, data.num_microbatches, lay,
                      zero_stage=lay.zero_stage, pp_schedule=lay.pp_schedule, act_bytes=act_bytes,
                      grad_checkpointing=plan.model.grad_checkpointing == "full",
                      sequence_parallel=lay.sequence_parallel,
                      loss_chunk_size=run.loss_chunk_size if plan.model.chunked_loss else 0)
    mem = est["memory_gb"]
    parts = dict(weights=mem["weights"] * GIB, grads=mem["grads"] * GIB, optimizer=mem["optimizer"] * GIB,
                 activations=mem["activations"] * GIB * ACTIVATION_OVERHEAD)
    if stage.name.lower().startswith("lora"):  # frozen base: no gradients or moments but the adapters' (small)
        parts["grads"] = parts["optimizer"] = 0.0
    est["notes"] = []
    parts.update(extra_models(plan, config, run, est, act_bytes))
    return parts, est


def extra_models(plan, config, run, est, act_bytes):
    """Bytes per device of the models and caches beside the policy: the frozen reference, a teacher, PPO's value
    head, a reward model, the rollouts' KV cache; est["notes"] gets how each was counted."""
    stage, notes, parts = plan.stage, est["notes"], {}
    sizes = layout_sizes(plan.layout)
    rows, length = plan.micro_batch_shape
    per_rank_params = est["params_per_rank"]
    if getattr(stage, "uses_reference", False):  # RL: the frozen starting weights, fp32, laid out as the policy
        parts["reference"] = 4 * per_rank_params
    elif getattr(stage, "ref_sha256", ""):  # DPO/KTO with a reference: log-probs computed first, model dropped
        notes.append("reference: its log-probs are computed once before training and cached; the model is dropped "
                     "before the first step (not in the training peak)")
    if hasattr(stage, "teacher_config"):  # frozen, in the training dtype, its matrices split as the student's (tp)
        teacher, at_hand = stage.teacher_config, os.path.exists(stage.teacher_path)
        parts["teacher"] = model_params(teacher) * act_bytes / divisor(sizes, "matrices")
        kept = teacher.hidden_size if plan.model.chunked_loss else teacher.vocab_size / divisor(sizes, "matrices")
        parts["teacher_outputs"] = rows * length * kept * (act_bytes if plan.model.chunked_loss else 4)
        notes.append(f"teacher: hidden {teacher.hidden_size}, {teacher.num_hidden_layers} layers"
                     f"{', MoE' if teacher.use_moe else ''}, {model_params(teacher) / 1e6:.1f}M parameters"
                     + (f" ({stage.teacher_path})" if at_hand else
                        " (not at hand: MiniMind's default, the student's size as MoE, or --teacher_hidden_size, "
                        "--teacher_num_hidden_layers, --teacher_use_moe)"))
    if stage.name == "PPO":  # the value head (hidden + 1) trains: weights, gradients and moments as the policy's
        state = (est["memory_gb"]["weights"] + est["memory_gb"]["grads"] + est["memory_gb"]["optimizer"]) * GIB
        parts["value_head"] = state / per_rank_params * (config.hidden_size + 1)
    reward_model = getattr(run, "reward_model", None)
    if reward_model:  # loaded in fp32, whole on every rank (rewards.RewardModel)
        params = reward_model_params(reward_model)
        parts["reward_model"] = 4 * (params or est["total_params"])
        notes.append(f"reward model: {params / 1e6:.1f}M parameters ({reward_model})" if params else
                     f"reward model: {reward_model} not at hand, assumed the policy's size")
    if hasattr(stage, "max_gen_len"):  # the rollout's KV cache: every row, prompt + completion, each layer K and V
        kv_dim = config.num_key_value_heads * config.head_dim
        layers = math.ceil(config.num_hidden_layers / divisor(sizes, "layers"))
        parts["rollout_kv_cache"] = 2 * layers * rows * length * kv_dim / divisor(sizes, "matrices") * act_bytes
    return parts


CACHE_KINDS = {"pretrain": ("pretrain",), "sft": ("sft",), "dpo": ("dpo_chosen", "dpo_rejected")}  # demo_kind: caches


def corpus_tokens(path, tokenizer_path, sample_lines=SAMPLE_LINES, cache_dir=None, kinds=(), skip_bad_lines=False):
    """(tokens, documents, how): from the trainer's token cache of `path` when one is there (its meta.json's counts;
    kinds: the caches the stage's dataset builds, summed), else the tokens of every string in the first
    `sample_lines` JSON lines, scaled by the file's bytes over the sample's bytes (the whole file when that short)."""
    from transformers import AutoTokenizer  # only a plan with a corpus needs it
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    cached = cached_counts(path, tokenizer, cache_dir, kinds, skip_bad_lines)
    if cached:
        return cached
    size, lines, sample_bytes, tokens = os.path.getsize(path), 0, 0, 0
    with open(path, "rb") as f:
        for raw in f:
            lines += 1
            if lines <= sample_lines:
                sample_bytes += len(raw)
                tokens += sum(len(tokenizer(s, add_special_tokens=False)["input_ids"]) + 2
                              for s in strings(json.loads(raw)))
    scale = size / max(sample_bytes, 1)
    how = "counted" if lines <= sample_lines else f"{sample_lines} of {lines} lines tokenized, scaled by bytes"
    return int(tokens * scale), lines, how


def cached_counts(path, tokenizer, cache_dir, kinds, skip_bad_lines):
    """(tokens, documents, how) from the token caches the trainer built for `path` (dataset/shards.py's key: the file,
    its size and time, the tokenizer), or None unless every kind's cache is there."""
    if not kinds or not os.path.isfile(path):
        return None
    folders = [cache_dir_for(kind, path, tokenizer, skip_bad_lines, cache_dir) for kind in kinds]
    metas = [os.path.join(folder, "meta.json") for folder in folders]
    if not all(os.path.isfile(meta) for meta in metas):
        return None
    counts = []
    for meta in metas:
        with open(meta) as f:
            counts.append(json.load(f))
    return (sum(c["num_tokens"] for c in counts), counts[0]["num_docs"],
            "the token cache " + ", ".join(os.path.basename(f) for f in folders))


def strings(value):
    """Every string in a JSON value (texts, conversation turns, chosen/rejected)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def active_params(config, total):
    """Parameters a token passes through: all, less the routed experts it does not reach."""
    if not config.use_moe:
        return total
    unused = 1 - config.num_experts_per_tok / config.num_experts
    return total - config.num_hidden_layers * routed_expert_params(config) * unused


def estimate(stage_name, argv, nproc=1, gpu=None, mfu=None, usd_per_hour=None, data_tokens=None, act_bytes=None,
             teacher=None):
    """The plan as a dict: parameters, memory per device by part (GiB), fits, the cheapest change that fits, the
    FLOPs per token and, with the corpus's tokens, the time and cost of an epoch on `nproc` of `gpu`; teacher: the
    fields of a distillation/GKD teacher not at hand (default: the student's size as MoE)."""
    plan, run = stage_plan(stage_name, argv, nproc, teacher)
    config = plan.model.config
    parts, est = memory_parts(plan, config, run, act_bytes)
    total = sum(parts.values())
    sizes = layout_sizes(plan.layout)
    dtype, dtype_note = planned_dtype(run.dtype, gpu and find_gpu(gpu)[0])
    out = dict(stage=stage_name, nproc=nproc, dtype=dtype, layout=dict(sizes, zero_stage=plan.layout.zero_stage),
               micro_batch_rows=plan.micro_batch_shape[0], row_tokens=plan.micro_batch_shape[1],
               params_total=est["total_params"], params_active=active_params(config, est["total_params"]),
               memory_gib={k: v / GIB for k, v in parts.items()}, memory_total_gib=total / GIB,
               notes=est["notes"] + [dtype_note] * bool(dtype_note))
    seq_len = plan.micro_batch_shape[1] * divisor(sizes, "tokens")
    out["train_flops_per_token"] = model_flops_per_token(config, seq_len) + frozen_forward_flops(plan.stage, config,
                                                                                                seq_len)
    if gpu is None:
        return out
    name, (peak, memory, bandwidth, source) = find_gpu(gpu)
    mfu = mfu or (DEFAULT_MFU_MOE if config.use_moe else DEFAULT_MFU)
    usable = usable_bytes(memory)
    out.update(gpu=name, gpu_source=source, gpu_memory_gib=memory / GIB, usable_gib=usable / GIB,
               fits=total <= usable, mfu=mfu, peak_flops=peak)
    if total > usable:
        out["cheapest_fix"] = cheapest_fix(stage_name, argv, nproc, plan, usable, act_bytes, teacher)
    if data_tokens:
        tokens, documents, how = data_tokens
        # packed rows train every token once; unpacked rows (chat, pairs, an RL prompt's completions) are full rows
        positions = tokens if plan.data.packing else documents * plan.micro_batch_shape[0] // plan.data.micro_batch \
            * seq_len
        seconds = out["train_flops_per_token"] * positions / (peak * mfu * nproc)
        out.update(corpus_tokens=tokens, corpus_documents=documents, corpus_count=how, epoch_positions=positions,
                   epoch_hours=seconds / 3600)
        if hasattr(plan.stage, "max_gen_len"):  # decoding reads every weight (bf16) once per generated token
            out["rollout_note"] = ("RL: generation not included; it is memory-bound: about "
                                   f"{2 * out['params_total'] / bandwidth * 1e3:.3f} ms per decoding step")
        if usd_per_hour:
            out["epoch_usd"] = out["epoch_hours"] * usd_per_hour * nproc
    return out


def usable_bytes(memory):
    """The tensor bytes a card of `memory` bytes holds: less the CUDA context, over the allocator's slack."""
    return (memory - CUDA_CONTEXT_GIB * GIB) / (1 + ALLOCATOR_SLACK)


def frozen_forward_flops(stage, config, seq_len):
    """FLOPs per token of the frozen models' forward passes (a third of their training FLOPs: 2 of 6 per parameter),
    as the stage's own flops() counts them: RL's reference, a distillation/GKD teacher."""
    flops = model_flops_per_token(config, seq_len) / 3 if getattr(stage, "uses_reference", False) else 0
    if hasattr(stage, "teacher_config"):
        flops += model_flops_per_token(stage.teacher_config, seq_len) / 3
    return flops


def cheapest_fix(stage_name, argv, nproc, plan, memory, act_bytes=None, teacher=None):
    """The first change, cheapest first, whose estimate fits `memory` (the card's usable bytes): a smaller
    micro-batch (accumulation keeps the global batch), --grad_checkpointing 1, ZeRO-2/3 (several processes),
    --cpu_offload, a smaller --max_gen_len; or None."""
    batch, accumulation = plan.data.micro_batch, plan.data.num_microbatches
    tries = []
    while batch > 1:
        batch, accumulation = batch // 2, accumulation * 2
        tries.append(["--batch_size", str(batch), "--accumulation_steps", str(accumulation)])
    tries += [t + ["--grad_checkpointing", "1"] for t in tries[-1:] or [[]]]
    if nproc > 1:
        tries += [tries[-1] + ["--zero_stage", str(z)] for z in (2, 3)]
        tries.append(tries[-1] + ["--cpu_offload", "1"])
    if hasattr(plan.stage, "max_gen_len"):
        tries += [tries[-1] + ["--max_gen_len", str(plan.stage.max_gen_len // d)] for d in (2, 4)]
    for change in tries:
        try:
            new_plan, run = stage_plan(stage_name, argv + change, nproc, teacher)
        except Exception:  # noqa: BLE001 a change this layout refuses is not a fix
            continue
        parts, _ = memory_parts(new_plan, new_plan.model.config, run, act_bytes)
        if sum(parts.values()) <= memory:
            return dict(flags=" ".join(change), memory_total_gib=sum(parts.values()) / GIB)
    return None


def describe(out):
    """The plan in lines a person reads."""
    mem = ", ".join(f"{k} {v:.2f}" for k, v in out["memory_gib"].items())
    lines = [f"{out['stage']} on {out['nproc']} x {out['gpu']} in {out['dtype']} ({out['gpu_memory_gib']:.0f} GiB, "
             f"{out['usable_gib']:.1f} for tensors; {out['gpu_source']})",
             f"parameters: {out['params_total'] / 1e6:.1f}M total, {out['params_active'] / 1e6:.1f}M active",
             f"memory per GPU (GiB): {mem}; total {out['memory_total_gib']:.2f}: "
             + ("fits" if out["fits"] else "does NOT fit")]
    if not out["fits"]:
        fix = out.get("cheapest_fix")
        lines.append(f"cheapest change that fits: {fix['flags']} ({fix['memory_total_gib']:.2f} GiB)" if fix else
                     "no single change fits: add GPUs with --nproc and --zero_stage 3, or --tp")
    if "corpus_tokens" in out:  # a given count has no lines: only a counted corpus says how many
        lines_read = "" if out["corpus_count"].startswith("given") else f" in {out['corpus_documents']} lines"
        lines.append(f"corpus: {out['corpus_tokens'] / 1e6:.2f}M tokens{lines_read} ({out['corpus_count']}); "
                     f"{out['train_flops_per_token'] / 1e6:.1f} MFLOP per trained token")
    at = f"at MFU {out['mfu']:.0%} of {out['peak_flops'] / 1e12:.4g} TFLOP/s"
    if "epoch_hours" in out:
        lines.append(f"time per epoch: {span(out['epoch_hours'])} {at}" + cost(out.get("epoch_usd")))
    if "updates_hours" in out:
        lines.append(f"time per epoch: not estimated for RL (generation, memory-bound, takes most of it); the policy's "
                     f"updates alone: {span(out['updates_hours'])} {at}" + cost(out.get("updates_usd")))
    if "rollout_note" in out:
        lines.append(out["rollout_note"])
    lines += out["notes"]
    return "\n".join(lines)


def span(hours):
    """A duration a person reads: hours, minutes, or seconds under a minute (a small corpus's epoch)."""
    return f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.1f} min" if hours >= 1 / 60 else \
        f"{hours * 3600:.2g} s"


def cost(usd):
    """'; cost $X' (two figures under a cent), or nothing without --usd_per_hour."""
    return "" if usd is None else f"; cost ${usd:.2f}" if usd >= 0.01 else f"; cost ${usd:.2g}"


def rl_updates(out, bandwidth):
    """An RL plan's epoch figures are its updates' only (generation is not counted): named so; without the card's
    bandwidth (an unlisted card without --gpu_bandwidth_gbs) the decoding step's time is not given."""
    if "rollout_note" not in out:
        return out
    for old, new in (("epoch_hours", "updates_hours"), ("epoch_usd", "updates_usd")):
        if old in out:
            out[new] = out.pop(old)
    if math.isnan(bandwidth):
        out["rollout_note"] = ("RL: generation not included; it is memory-bound: give --gpu_bandwidth_gbs for the "
                               "time of a decoding step")
    return out


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)  # a bad plan flag: one line, exit 2
    try:
        stage, defaults = script_stage(args.stage)
        data = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--data_path"), None)
        if data is None:
            from dataset.demo_data import ensure_demo_data  # the stage's demo corpus, as its script would use
            data = ensure_demo_data(stage.demo_kind)
        teacher = dict(hidden_size=args.teacher_hidden_size, num_hidden_layers=args.teacher_num_hidden_layers,
                       use_moe=None if args.teacher_use_moe is None else bool(args.teacher_use_moe))
        plan, _ = stage_plan(args.stage, rest, args.nproc, teacher)
        tokens = corpus_tokens(data, plan.data.tokenizer_path, cache_dir=plan.data.cache_dir,
                               kinds=CACHE_KINDS.get(stage.demo_kind, ()),
                               skip_bad_lines=plan.data.skip_bad_lines) if args.corpus_tokens is None else \
            (int(args.corpus_tokens), int(args.corpus_tokens) // plan.data.seq_len, "given (--corpus_tokens)"
             + ("" if plan.data.packing else f"; its rows taken as full rows of {plan.data.seq_len} tokens"))
        out = estimate(args.stage, rest, args.nproc, args.card, args.mfu, args.usd_per_hour, tokens, teacher=teacher)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    out = rl_updates(out, args.card[1][2])
    print(json.dumps(out, indent=1) if args.json else describe(out))
    return out
