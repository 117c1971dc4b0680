"""The plan: one frozen TrainPlan of frozen sections, and every flag of the training scripts declared once in its
section (trainer/base/schema.py says how); trainer/plan/flags.py builds the parser from these,
trainer/plan/resolve.py's resolve fills them. The engine's sections live beside their code: `optim`
(trainer/runtime/optimizer_choice.py), `lr` (trainer/runtime/schedule.py), `callbacks` (trainer/runtime/callbacks.py); a
stage's plan (trainer/plan/stage.py) is `stage`, its flags in its own FLAGS.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from model.model_minimind import MiniMindConfig
from trainer.base.schema import Flag
from trainer.parallel.mesh import MODEL_DIMS
from trainer.plan.stage import Stage
from trainer.runtime.callbacks import CallbackPlan
from trainer.runtime.optimizer_choice import OptimizerPlan
from trainer.runtime.schedule import LRSchedule


@dataclass(frozen=True)
class Layout:
    """The processes, their device and the parallel layout (trainer/parallel/)."""
    world_size: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int  # the one used
    dp_mode: str  # "none" (no data-parallel group), "ddp", "zero1" or "fsdp2"
    grad_compression: str
    powersgd_rank: int
    powersgd_start_step: int
    pp_schedule: str
    sequence_parallel: bool
    cpu_offload: bool
    device: str  # cuda:<local rank>
    dist_timeout: int
    dist_init_timeout: int
    FLAGS = (
        Flag("tp", int, 1, "tensor-parallel degree"),
        Flag("pp", int, 1, "pipeline-parallel degree (micro-batches = --accumulation_steps)"),
        Flag("cp", int, 1, "context-parallel (ring attention) degree"),
        Flag("ep", int, 1, "expert-parallel degree: each MoE layer's experts sharded over this many data-parallel "
             "ranks, tokens sent by all-to-all; must divide the dp size; composes with --tp, --pp and --cp "
             "(--zero_stage 0/2/3)", min=1),
        Flag("zero_stage", int, 0, "0: DDP, 1: sharded optimizer, 2: +gradients, 3: +parameters (FSDP2)"),
        Flag("grad_compression", str, "none", "none|bf16|powersgd (DDP communication hook)"),
        Flag("powersgd_rank", int, 1, "--grad_compression powersgd: rank of the low-rank approximation", min=1),
        Flag("powersgd_start_step", int, 1000, "--grad_compression powersgd: optimizer steps of exact all-reduce "
             "before compression starts (warm-up; a resumed run warms up again)",
             min=2, hint="torch's PowerSGD runs 2 exact steps first"),
        Flag("pp_schedule", str, "1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved1f1b")),
        Flag("sequence_parallel", bool, 0, "shard norms along the sequence (tp > 1)"),
        Flag("cpu_offload", bool, 0, "FSDP2 (--zero_stage 2/3): keep sharded parameters, gradients and optimizer "
             "state in CPU memory (CUDA only; the optimizer step runs on the CPU)"),
        Flag("device", str, "cuda:0" if torch.cuda.is_available() else "cpu", "cpu or cuda[:N]"),
        Flag("dist_timeout", int, 600, "seconds a collective may hang once training runs (from step 2)", min=1),
        Flag("dist_init_timeout", int, 1800, "seconds for start-up to the end of the first step (rendezvous, token "
             "cache, loading weights, compile) before a hung collective fails", min=1),
    )

    @property
    def has_dtensor(self):
        """Parameters are DTensors (tensor parallel or FSDP2): no fused AdamW, losses may be DTensors."""
        return self.tp > 1 or self.dp_mode == "fsdp2"

    @property
    def model_sizes(self):
        """The sizes of the dimensions that do not split the data, by name (parallel/mesh.py's table)."""
        return {name: getattr(self, name) for name in MODEL_DIMS}

    @property
    def copies_of_data(self):
        """How many ranks hold the same samples (the ranks of the dimensions that do not split the data)."""
        return self.world_size // self.dp


@dataclass(frozen=True)
class ModelPlan:
    """The model the flags (and the --from_weight file) describe, where it starts from, and how it computes."""
    config: MiniMindConfig
    from_weight: str  # "none" or a path
    dtype: torch.dtype
    dtype_note: str  # --dtype auto: how it chose (the measured rates), said once at start; "" for a typed dtype
    chunked_loss: bool  # lm_head + CE on target tokens only (off under tp and pp)
    grad_checkpointing: Optional[str]  # the mode: None, "full", "attention" or "mlp"
    use_compile: bool
    router_balance: str
    router_bias_rate: float
    expert_compute: str
    tf32: bool
    deterministic: bool
    SHAPE_FLAGS = (  # MiniMindConfig's fields (model_config.build_config; a --from_weight file's shapes win)
        Flag("hidden_size", int, 768, "model width", min=1),
        Flag("num_hidden_layers", int, 8, "decoder blocks", min=1),
        Flag("num_attention_heads", int, 8, "query heads", min=1),
        Flag("num_key_value_heads", int, 4, "key/value heads (GQA)", min=1),
        Flag("intermediate_size", int, None, "dense MLP width (default: the model's rule)", min=1),
        Flag("moe_intermediate_size", int, None, "expert MLP width (default: the model's rule)", min=1),
        Flag("head_dim", int, None, "attention head size (default: hidden_size / heads)", min=1),
        Flag("use_moe", bool, 0, "mixture-of-experts MLPs"),
        Flag("num_experts", int, 4, "experts per MoE layer", min=1),
        Flag("num_experts_per_tok", int, 1, "experts each token is routed to", min=1),
    )
    FLAGS = (
        Flag("from_weight", str, "none", "weight prefix in save_dir, a .pth path, or none"),
        Flag("dtype", str, "auto", "auto|bfloat16|float16|float32 (auto: bf16 where the device has it)"),
        Flag("grad_checkpointing", str, "0", "recompute activations in backward: full (1) each decoder block (least "
             "memory, ~1/3 more compute), attention or mlp only that sub-layer of each block; 0/none: off",
             choices=("0", "1", "none", "full", "attention", "mlp")),
        Flag("use_compile", bool, 0, "torch.compile each decoder block"),
        Flag("router_balance", str, "aux", "MoE load balancing: aux (MiniMind's aux loss), bias (DeepSeek-V3's "
             "aux-loss-free routing bias, moved toward equal load after each step; no aux loss) or both",
             choices=("aux", "bias", "both")),
        Flag("router_bias_rate", float, 1e-3, "--router_balance bias/both: how far each step moves an expert's bias"),
        Flag("expert_compute", str, "auto", "MoE experts: grouped (torch's grouped matmul, no host sync), loop (one "
             "MLP call per expert, one host sync per layer) or auto (grouped where it runs on this device and dtype)",
             choices=("auto", "grouped", "loop")),
        Flag("tf32", bool, 1, "CUDA: fp32 matmuls in TF32 (0: strict fp32)"),
        Flag("deterministic", bool, 0, "torch.use_deterministic_algorithms (CUDA: CUBLAS_WORKSPACE_CONFIG, no cuDNN "
             "autotuning); an op without a deterministic kernel then raises"),
    ) + SHAPE_FLAGS + (
        Flag("dropout", float, 0.0, "dropout on the embeddings and each attention output (MiniMind's config.dropout; "
             "draws from each rank's RNG, so layouts differ from one process when > 0)"),
        Flag("loss_chunk_size", int, 1024, "lm_head + cross-entropy over chunks of this many tokens, never the full "
             "logits (0: off)", min=0, hint="0 is off"),
    )

    @property
    def autocast_dtype(self):
        return None if self.dtype == torch.float32 else self.dtype


@dataclass(frozen=True)
class DataPlan:
    """What a step reads: the data, the batch shape, the tokenizer and the token cache; the seed of the data order."""
    data_path: Optional[str]  # a spec for dataset.mixture.resolve_data_spec
    eval_data_path: Optional[str]
    seq_len: int  # tokens per row (--max_seq_len; a stage's own: prompt + completion)
    micro_batch: int  # samples per micro-batch per dp rank
    num_microbatches: int
    global_batch: int  # samples per optimizer step over all dp ranks
    packing: bool
    doc_mask: bool
    skip_bad_lines: bool
    num_workers: int
    num_proc: Optional[int]
    cache_dir: str
    tokenizer_path: str
    tokenizer_record: dict  # {"path", "sha256" of its tokenizer.json}: written beside the weights and checkpoints
    seed: int
    eval_batches: int
    FLAGS = (
        Flag("data_path", str, None, "JSONL, parquet or token shard; a directory, a glob, or a comma list with "
             "optional weights, e.g. a.jsonl:0.7,shards/*.parquet:0.3 (default: the embedded demo corpus)"),
        Flag("eval_data_path", str, None, "held-out data for eval_loss / eval_ppl, same forms (default: none)"),
        Flag("packing", bool, 0, "fill whole rows (max_seq_len tokens): pretraining joins documents; SFT packs whole "
             "conversations, on by default there (chat rows are mostly far shorter)"),
        Flag("doc_mask", bool, 1, "with --packing 1: a token attends only to earlier tokens of its own document and "
             "position ids restart at each document (0: the whole row is one sequence)"),
        Flag("skip_bad_lines", bool, 0, "skip malformed data lines instead of stopping"),
        Flag("num_workers", int, 0, "DataLoader worker processes", min=0),
        Flag("num_proc", int, None, "tokenizer worker processes per rank while building the token cache (default: the "
             "cores available / local ranks)", min=1, hint="leave it unset for the cores available"),
        Flag("cache_dir", str, None, "token cache of the datasets (default: dataset/.cache in the repo)"),
        Flag("tokenizer_path", str, None, "Hugging Face tokenizer folder (default: the one the starting weights were "
             "trained with, as their sidecar records; else model/ in the repo)"),
        Flag("seed", int, 42, "model init and data order (a pure function of seed and epoch)",
             min=0, hint="numpy takes 0 to 2**32-1"),
        Flag("eval_batches", int, 50, "batches per validation run", min=1),
        Flag("max_seq_len", int, 340, "tokens per sample", min=2),
        Flag("batch_size", int, 32, "samples per micro-batch per data-parallel rank", min=1),
        Flag("accumulation_steps", int, 8, "micro-batches per optimizer step (pipeline: micro-batches)", min=1),
        Flag("force_tokenizer", bool, 0, "1: use the tokenizer folder given even where its tokenizer.json differs from "
             "the one the starting weights were trained with"),
    )


@dataclass(frozen=True)
class Schedule:
    """How long the run goes, and when it logs, evaluates and saves."""
    epochs: int
    max_steps: int
    max_tokens: int
    log_interval: Optional[int]
    eval_interval: int
    save_interval: int
    save_weights_every: int
    save_every_minutes: float
    FLAGS = (
        Flag("epochs", int, 1, "passes over the training data", min=1),
        Flag("max_steps", int, 0, "stop after this many optimizer steps, the lr schedule's length (0: run all epochs)",
             min=0, hint="0 runs all epochs"),
        Flag("max_tokens", int, 0, "stop after the optimizer step that reaches this many target tokens (all ranks; 0: "
             "no token budget); the lr schedule keeps its length", min=0, hint="0 is no token budget"),
        Flag("log_interval", int, None, "optimizer steps between metrics records (default: 100, or fewer so that an "
             "epoch has at least ten)", min=1),
        Flag("eval_interval", int, 0, "optimizer steps between validation runs (0: only at the end)",
             min=0, hint="0 evaluates at the end only"),
        Flag("save_interval", int, 100, "optimizer steps between weights + resume checkpoints", min=1),
        Flag("save_weights_every", int, 0, "also write the <save_weight>.pth weights every N steps (0: at the end "
             "only)", min=0, hint="0 saves at the end only"),
        Flag("save_every_minutes", float, 10, "also save a resume checkpoint at the step after which the next would "
             "end more than this many minutes after the last save, so that a slow run loses little (0: off)"),
    )


@dataclass(frozen=True)
class IOPlan:
    """Where the run writes (weights, checkpoints, metrics, logs, traces) and where it resumes from."""
    save_dir: str
    checkpoint_dir: str
    run_name: str  # MiniMind's weight stem <save_weight>_<hidden>[_moe]
    weights_path: str  # <save_dir>/<run_name>.pth
    run_dir: str  # <checkpoint_dir>/<run_name>: this run's resume checkpoints
    save_dtype: torch.dtype
    from_resume: str  # "0", "1" or "auto"
    resume_path: Optional[str]  # --from_resume <step dir>: that checkpoint instead of the newest
    overwrite: bool
    keep_checkpoints: int
    async_save: bool
    metrics_file: str
    tensorboard_dir: Optional[str]
    trackers: tuple  # dashboards besides the metrics JSONL: swanlab, wandb, tensorboard
    use_wandb: bool
    wandb_project: str
    log_dir: Optional[str]  # None: off
    report: str
    profile_steps: Optional[tuple]
    FLAGS = (
        Flag("save_dir", str, None, "where weights and metrics go (default: out/ in the repo)"),
        Flag("checkpoint_dir", str, None, "where resume checkpoints go (default: checkpoints/ in the repo)"),
        Flag("save_dtype", str, "float16", "dtype of the saved weights", choices=("float16", "bfloat16", "float32")),
        Flag("from_resume", str, "0", "1: continue from the newest complete checkpoint; auto: that, or start fresh if "
             "there is none (for torchrun --max-restarts); or a step_<N> directory: continue from that checkpoint "
             "(later ones of this run are dropped at its first save)"),
        Flag("overwrite", bool, 0, "1: start over although this run name has checkpoints or weights from an earlier "
             "run (its checkpoints are removed, its weights replaced); without it such a run is refused"),
        Flag("keep_checkpoints", int, 3, "complete resume checkpoints kept; older ones are deleted (0: all)",
             min=0, hint="0 keeps all"),
        Flag("async_save", bool, 0, "write resume checkpoints in the background (dcp.async_save)"),
        Flag("metrics_file", str, None, "JSONL records (default: "
             "<save_dir>/<save_weight>_<hidden>[_moe]_metrics.jsonl)"),
        Flag("tensorboard_dir", str, None, "also write TensorBoard scalars here (default: off)"),
        Flag("use_wandb", bool, False, "MiniMind's flag: --tracker swanlab (offline when not logged in)",
             action="store_true"),
        Flag("wandb_project", str, "MiniMind", "swanlab / wandb project name"),
        Flag("log_dir", str, None, "each rank's timestamped log, <save_weight>_<hidden>[_moe]_rank_<N>.log (default: "
             "<save_dir>/logs; none: off)"),
        Flag("report", str, "auto", "at the end, rank 0 writes <save_dir>/<run>_report.md and its plots "
             "(scripts/report.py's page): 1 always, 0 never (the command is printed), auto for runs of a minute or "
             "more", choices=("auto", "1", "0")),
        Flag("profile_steps", str, None, "A:B: torch.profiler trace of optimizer steps A to B under "
             "<save_dir>/profile (default: off)"),
        Flag("save_weight", str, "pretrain", "weight file prefix: <save_dir>/<save_weight>_<hidden>[_moe].pth"),
        Flag("tracker", str, None, "comma list of swanlab, wandb (offline unless WANDB_MODE=online), tensorboard "
             "(--tensorboard_dir, default <save_dir>/tensorboard), none (default: from --use_wandb and "
             "--tensorboard_dir); the metrics JSONL is always written"),
        Flag("config", str, None, "a YAML file of flags (the same names, e.g. learning_rate: 1.0e-3); the command line "
             "overrides it; each run writes its flags to <checkpoint_dir>/<save_weight>_<hidden>[_moe]_config.yaml, "
             "which repeats it"),
    )


@dataclass(frozen=True)
class GuardPlan:
    """Preemption and the non-finite step guard (trainer/runtime/signals.py, trainer/runtime/step_guard.py); the replica
    check (trainer/parallel/data.py check_replicas)."""
    grace_seconds: float
    max_bad_steps: int
    check_replicas: int
    FLAGS = (
        Flag("grace_seconds", float, 60, "after SIGTERM/SIGINT: seconds to finish the step and save before exiting "
             "non-zero"),
        Flag("max_bad_steps", int, 5, "stop after this many non-finite (skipped) optimizer steps in a row", min=1),
        Flag("check_replicas", int, 0, "every N steps compare parameter checksums across data-parallel replicas (0: "
             "off)", min=0, hint="0 is off"),
    )


# the sections in the order --help lists their flags
SECTIONS = (IOPlan, Schedule, DataPlan, ModelPlan, OptimizerPlan, LRSchedule, Layout, GuardPlan, CallbackPlan)


@dataclass(frozen=True)
class TrainPlan:
    """Everything derived from the flags, once, in sections; `flags`: the flags as typed, saved in checkpoints and the
    tracker's config, never read by the trainer."""
    layout: Layout
    model: ModelPlan
    data: DataPlan
    schedule: Schedule
    optim: OptimizerPlan  # trainer/runtime/optimizer_choice.py
    lr: LRSchedule  # trainer/runtime/schedule.py
    io: IOPlan
    guard: GuardPlan
    callbacks: CallbackPlan  # trainer/runtime/callbacks.py: best checkpoint, early stopping, the user's
    flags: dict
    stage: Stage = Stage()  # the stage's own checked plan (trainer/plan/stage.py): its hooks, objective and datasets

    @property
    def micro_batch_shape(self):
        """(rows, tokens) of one micro-batch on one rank (tokens after context parallel's split); a stage may put
        several rows in one sample (DPO: a chosen/rejected pair), its plan says how many (rows_per_sample)."""
        return self.data.micro_batch * self.stage.rows_per_sample, self.data.seq_len // self.layout.cp

    @property
    def row_multiple(self):
        """What a micro-batch's rows are cut to a multiple of (trainer/core/data_loading.py LongestRows): 8 on CPU
        (little padding), 64 on CUDA (tensor-core tiles, few shapes), and what the layout splits a row by (2*cp: each
        cp rank's head and tail chunks; cp*tp under sequence parallel). None: rows keep --max_seq_len (a pipeline's
        fixed stage shapes, packed rows, a stage whose samples are not padded rows)."""
        layout = self.layout
        if not self.stage.padded_rows or self.data.packing or layout.pp > 1:
            return None
        split = layout.cp * layout.tp if layout.sequence_parallel else 1
        return math.lcm(64 if layout.device.startswith("cuda") else 8, 2 * layout.cp if layout.cp > 1 else 1, split)
