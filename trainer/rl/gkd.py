"""On-policy distillation, GKD (Agarwal et al., "On-Policy Distillation of Language Models"; TRL's GKDTrainer): the
stage plan, its checks and the objective.

Each step is either on-policy (a fraction --lmbda of the steps, chosen by a hash of (seed, step), so a resume repeats
the choice) or offline. On-policy, `prepare` cuts each chat row at its first assistant token (the prompt), the student
completes it with the rollout engine (trainer/rl/rollout.py, seeded by (seed, step, rank, micro-batch)) and the
completion becomes the row's targets (trainer/rl/rows.py); offline, the row's own answer is. The loss of every target
position is TRL's generalized JSD between the teacher's and the student's whole next-token distributions, both at
--temperature: beta 0 KL(teacher || student), beta 1 KL(student || teacher), in between
beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta teacher + (1 - beta) student; the step's loss is its mean
over the step's target tokens. The teacher (any size, dense or MoE, the student's tokenizer) is loaded as offline
distillation loads it (trainer/stages/distillation.py).
"""
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoTokenizer

from dataset.chat import SFTDataset
from model.errors import ConfigError
from model.model_minimind import MiniMindConfig
from model.provenance import content_sha256
from model.weights.paths import file_digest, weight_name
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.core.batches import autocast
from trainer.observe.metrics import step_flops
from trainer.plan.objective import LMObjective
from trainer.rl.base import RolloutObjective, RolloutPlan, check_layout, check_positions, engine_line
from trainer.rl.rollout import make_engine, rollout_seed
from trainer.rl.rows import rollout_sequences, training_rows
from trainer.stages.distillation import DistillationPlan, build_teacher, teacher_fields, teacher_path
from trainer.stages.sft import SFTStage

SHARED = ("max_gen_len", "temperature", "top_p", "rollout_engine", "rollout_url", "rollout_timeout")  # RolloutPlan's


def shared_flags(plan_class, names):
    return tuple(f for f in plan_class.FLAGS if f.name in names)


@dataclass(frozen=True)
class GKDPlan(SFTStage):
    """GKD's checked flags: the divergence (beta, temperature), the on-policy share (lmbda), generation and the
    teacher. Its data and held-out metric are SFT's (the student's CE on the answers)."""
    beta: float
    lmbda: float
    temperature: float
    max_prompt_len: int
    max_gen_len: int
    top_p: float
    rollout_engine: str
    rollout_url: Optional[str]
    rollout_timeout: float
    teacher_path: str
    teacher_fields: dict
    teacher_sha256: str = None
    name = "GKD"
    FLAGS = (*shared_flags(DistillationPlan, ("teacher_weight",)), *shared_flags(RolloutPlan, SHARED),
             Flag("beta", float, 0.5, "generalized JSD's interpolation: 0 KL(teacher || student) (forward), 1 "
                  "KL(student || teacher) (reverse), between: the JSD with mixture beta teacher + (1 - beta) student"),
             Flag("lmbda", float, 0.5, "share of steps trained on the student's own completions (on-policy); the "
                  "others train on the data's answers (TRL's lmbda)"))

    @classmethod
    def resolve(cls, args, plan):
        return resolve_gkd(args, plan)

    def sequence_length(self, max_seq_len):
        """Training rows hold the prompt (at most --max_seq_len tokens) and a completion."""
        return max_seq_len + self.max_gen_len

    def dataset(self, plan, tokenizer, path):
        """Chat rows of --max_seq_len tokens (each conversation in its own row: its first answer's prefix is the
        prompt)."""
        data = plan.data
        return SFTDataset(path, tokenizer, max_length=self.max_prompt_len, skip_bad_lines=data.skip_bad_lines,
                          cache_dir=data.cache_dir, num_proc=data.num_proc)

    def objective(self, plan, dims, train_ds):
        """The JSD with the frozen teacher and the student's rollout engine; the run's line at start."""
        tokenizer = AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
        teacher = build_teacher(self, plan, dims)
        engine = make_engine(plan, tokenizer, dims, lambda: autocast(plan))
        Logger(describe(self, plan, teacher))
        return GKDObjective(self, plan, dims, engine, tokenizer, teacher)

    @property
    def teacher_config(self):
        return MiniMindConfig(**self.teacher_fields)

    def resume_fields(self):
        return {"--teacher_weight": {"path": self.teacher_path, "sha256": self.teacher_sha256}, "--beta": self.beta,
                "--lmbda": self.lmbda, "--temperature": self.temperature}


def resolve_gkd(args, plan):
    """Check GKD's flags against the TrainPlan and the teacher against the student; ConfigError (one line)."""
    for name in ("beta", "lmbda"):
        value = getattr(args, name)
        if not 0 <= value <= 1:
            raise ConfigError(f"--{name} must lie in [0, 1] (got {value})")
    for name in ("temperature", "rollout_timeout"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ConfigError(f"--{name} must be a positive number (got {getattr(args, name)})")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must lie in (0, 1] (got {args.top_p})")
    check_layout(args, plan, "GKD")
    if plan.layout.tp > 1 or plan.layout.pp > 1:
        raise ConfigError("GKD runs data parallel only (--zero_stage 0-3): the JSD takes both models' whole "
                          "vocabulary on one rank and the teacher is not split into pipeline stages; drop --tp/--pp")
    check_positions(args.max_seq_len + args.max_gen_len, plan, "--max_seq_len + --max_gen_len")
    default = weight_name("full_sft", plan.model.config) + ("" if plan.model.config.use_moe else "_moe")
    path = teacher_path(args.teacher_weight or default, plan.io.save_dir)  # distillation's default: the MoE SFT model
    return GKDPlan(beta=float(args.beta), lmbda=float(args.lmbda), temperature=float(args.temperature),
                   max_prompt_len=args.max_seq_len, max_gen_len=args.max_gen_len, top_p=float(args.top_p),
                   rollout_engine=args.rollout_engine, rollout_url=args.rollout_url,
                   rollout_timeout=float(args.rollout_timeout), teacher_path=path,
                   teacher_fields=teacher_fields(path, plan), teacher_sha256=content_sha256(path))


def describe(stage, plan, teacher):
    config = stage.teacher_config
    params = sum(p.numel() for p in teacher.parameters()) / 1e6
    return (f"GKD: student from {plan.model.from_weight} (--from_weight), teacher {stage.teacher_path}"
            f"{file_digest(stage.teacher_path)} ({params:.2f}M, hidden {config.hidden_size}, "
            f"{'MoE' if config.use_moe else 'dense'}); generalized JSD beta {stage.beta} at temperature "
            f"{stage.temperature}; {stage.lmbda:g} of the steps on-policy (up to {stage.max_gen_len} tokens, top_p "
            f"{stage.top_p}, {engine_line(stage)})")


def on_policy_step(seed, step, lmbda):
    """Whether step `step` trains on the student's completions: a uniform draw from a hash of (seed, step) below
    lmbda, the same on every rank and on a resume."""
    digest = hashlib.sha256(f"gkd:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64 < lmbda


def prompts_of(input_ids, labels, pad_id):
    """(prompt_ids (N, P) left-padded, prompt_lengths (N,)): each row's tokens before its first target (the
    conversation up to the first answer); a row without a target is a prompt as a whole (its padding cut)."""
    has_target = (labels != -100).any(1)
    first = torch.where(has_target, (labels != -100).int().argmax(1), (input_ids != pad_id).sum(1))
    lengths = first.clamp(min=1)
    width = int(lengths.max())
    prompt_ids = torch.full((input_ids.shape[0], width), pad_id, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        prompt_ids[i, width - n:] = input_ids[i, :n]
    return prompt_ids, lengths


def generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """(per-position generalized JSD, KL(student || teacher)) of logits (T, V) at `temperature` (TRL's
    generalized_jsd_loss before its reduction); fp32."""
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    reverse = (student.exp() * (student - teacher)).sum(-1)
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1), reverse
    if beta == 1:
        return reverse, reverse
    mixture = torch.logsumexp(torch.stack([student + math.log(1 - beta), teacher + math.log(beta)]), dim=0)
    to_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    return beta * to_teacher + (1 - beta) * (student.exp() * (student - mixture)).sum(-1), reverse


class GKDObjective(RolloutObjective):
    """The generalized JSD for train_step on the step's rows (the loader's, or the student's completions of their
    prompts, see `prepare`); logs on_policy (the step's kind) and reverse_kl, KL(student || teacher) per target
    token."""

    stat_names = ("rows", "on_policy_rows", "reverse_kl_sum")
    reuses_rollouts = False  # a step that generates nothing trains on the data's answers (offline), not a rollout
    unpack = LMObjective.unpack  # rows are (input_ids, labels) either way

    def __init__(self, stage, plan, dims, engine, tokenizer, teacher):
        super().__init__(stage, plan, dims, engine, tokenizer, functions=[], weights=[])
        self.teacher, self.on_policy = teacher, False

    def prepare(self, trainer, micro_batches):
        """On an on-policy step, each micro-batch's rows replaced by the student's completions of their prompts."""
        step = trainer.progress.global_step
        self.on_policy = on_policy_step(self.plan.data.seed, step, self.stage.lmbda)
        if not self.on_policy:
            self.trained_positions = sum(batch[0].numel() for batch in micro_batches)
            return micro_batches
        self.window_start = self.window_start or time.perf_counter()
        self.engine.sync(trainer)
        pad_id, rows = self.tokenizer.pad_token_id, []
        for index, batch in enumerate(micro_batches):
            prompt_ids, prompt_lengths = prompts_of(batch[0], batch[1], pad_id)
            seed = rollout_seed(self.plan.data.seed, step, self.dims.rank("dp"), index)
            rollout = self.generate(trainer, prompt_ids, prompt_lengths, 1, seed)
            rows.append(training_rows(rollout_sequences(rollout), pad_id))
        self.trained_positions = sum(ids.numel() for ids, _ in rows)
        return rows

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids, position_ids=position_ids).logits
        out = model(input_ids, position_ids=position_ids)
        mask = targets != -100
        jsd, reverse = generalized_jsd(out.logits[mask], teacher_logits[mask], self.stage.beta,
                                       self.stage.temperature)
        rows = torch.tensor(float(input_ids.shape[0]), device=jsd.device)
        stats = dict(rows=rows, on_policy_rows=rows * self.on_policy, reverse_kl_sum=reverse.detach().sum())
        return jsd.sum() / num_items, out.aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        raise RuntimeError("GKD has no pipeline schedule: resolve_gkd refuses --pp > 1")

    def record(self, stats, num_items):
        """on_policy (the share of the logged rows that were the student's completions), reverse_kl per target
        token, and the rollout speed."""
        return {"on_policy": stats["on_policy_rows"] / max(stats["rows"], 1.0),
                "reverse_kl": stats["reverse_kl_sum"] / num_items, **self.rollout_record()}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The student's training FLOPs and the teacher's forward (a third of its training FLOPs) on the rows as
        trained (their own length, not the plan's longest row); lm_head on every position."""
        rows = self.plan.micro_batch_shape[0] * self.plan.data.num_microbatches
        row_length = self.trained_positions / max(1, rows)
        trained = positions * row_length / seq_len
        student = step_flops(config, row_length, trained, target_tokens, False)
        return student + step_flops(self.stage.teacher_config, row_length, trained, target_tokens, False) / 3
