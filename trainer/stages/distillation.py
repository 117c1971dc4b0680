"""Knowledge distillation (train_distillation.py): MiniMind's loss alpha * CE + (1 - alpha) * T^2 *
KL(teacher || student) over the assistant tokens, with a frozen teacher beside the student in the same layout.

The KL runs over chunks of --loss_chunk_size target tokens (student and teacher lm_head per chunk), so neither
model's full fp32 logits exist at once; under tensor parallel both models' logits stay vocab-sharded instead.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoTokenizer

from model.errors import ConfigError
from model.model_minimind import CrossEntropyChunks, MiniMindConfig, MiniMindForCausalLM, chunked_head
from model.provenance import content_sha256
from model.weights.flag_advice import weights_line
from model.weights.paths import file_digest, other_sizes, typed_or_default, weight_name
from model.weights.shapes import WeightsError, weight_fields
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.ckpt.weights_file import any_weights_record, load_any_weights, read_any_weights
from trainer.core.log_probs import log_softmax
from trainer.observe.metrics import step_flops
from trainer.parallel.context import apply_context_parallel
from trainer.parallel.tensor import apply_tensor_parallel, tp_validate
from trainer.plan.objective import LMObjective
from trainer.stages.sft import SFTStage


@dataclass(frozen=True)
class DistillationPlan(SFTStage):
    """The distillation stage's checked flags: the loss weights and the teacher (a file and its model fields). Its data
    and held-out metric are SFT's (the student's CE); the objective adds the teacher's KL."""
    alpha: float  # weight of the CE; 1 - alpha weights T^2 * KL
    temperature: float
    teacher_path: str
    teacher_fields: dict  # MiniMindConfig fields of the teacher weights
    chunk_size: int  # target tokens per KL chunk; 0: the full logits (also under tensor parallel)
    teacher_sha256: str = None  # the teacher by content: a resume must distil from the same one
    name = "distillation"
    FLAGS = (  # MiniMind's defaults
        Flag("teacher_weight", str, None, "the teacher: a .pth, a resume checkpoint (step_<N> folder or *_resume.pth), "
             "a Hugging Face folder, or a weight name in save_dir (default: MiniMind's teacher, the MoE SFT model of "
             "the student's width, <save_dir>/full_sft_<hidden>_moe.pth); any size, dense or MoE, with the student's "
             "tokenizer"),
        Flag("alpha", float, 0.5, "loss = alpha * CE + (1 - alpha) * T^2 * KL(teacher || student)"),
        Flag("temperature", float, 1.5, "softmax temperature T of both models in the KL"),
    )

    @classmethod
    def resolve(cls, args, plan):
        return resolve_distillation(args, plan)

    def objective(self, plan, dims, train_ds):
        """The mixed loss with the teacher: frozen, eval mode, the training dtype, split like the student (tp, cp)."""
        teacher = build_teacher(self, plan, dims)
        Logger(describe(self, plan, teacher))
        return DistillationObjective(teacher, self)

    @property
    def teacher_config(self):
        return MiniMindConfig(**self.teacher_fields)

    def resume_fields(self):
        """The flags that shape the saved state (checked on resume, trainer/ckpt/resume.py)."""
        return {"--teacher_weight": {"path": self.teacher_path, "sha256": self.teacher_sha256}, "--alpha": self.alpha,
                "--temperature": self.temperature}


def resolve_distillation(args, plan):
    """Check --alpha, --temperature and the teacher against the student (vocabulary, tokenizer, layout)."""
    if not 0 <= args.alpha <= 1:
        raise ConfigError(f"--alpha must lie in [0, 1] (got {args.alpha}): the CE's weight, 1 - alpha the KL's")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ConfigError(f"--temperature must be a positive number (got {args.temperature}); MiniMind uses 1.5")
    if plan.layout.pp > 1:
        raise ConfigError("--pp > 1 is not supported by distillation (the teacher is not split into pipeline "
                          "stages); use --tp, --cp or data parallel")
    default = weight_name("full_sft", plan.model.config) + ("" if plan.model.config.use_moe else "_moe")
    path = teacher_path(args.teacher_weight or default, plan.io.save_dir)  # MiniMind's: the MoE SFT model
    fields = teacher_fields(path, plan)
    return DistillationPlan(alpha=args.alpha, temperature=args.temperature, teacher_path=path,
                            teacher_sha256=content_sha256(path), teacher_fields=fields,
                            chunk_size=plan.model.config.loss_chunk_size if plan.model.chunked_loss else 0)


def teacher_path(value, save_dir):
    """--teacher_weight as a path: a .pth or a folder as typed, else a weight name in save_dir."""
    if value.endswith(".pth") or os.sep in value or os.path.isdir(value):
        path = typed_or_default(value, None)
    else:
        path = os.path.join(save_dir, value + ".pth")
    if not os.path.exists(path):
        raise ConfigError(f"--teacher_weight: {path} does not exist; {other_sizes(path, '--teacher_weight')}"
                          "train the teacher first (MiniMind's: train_pretrain.py and train_sft.py with --use_moe 1) "
                          "or pass a .pth, a resume checkpoint or an HF folder")
    return path


def teacher_fields(path, plan):
    """The teacher's MiniMindConfig fields, after checking its vocabulary, tokenizer and tensor-parallel split."""
    try:
        state_dict, saved_config, _ = read_any_weights(path)
        fields = weight_fields(state_dict, saved_config)
    except WeightsError as e:
        raise ConfigError(f"--teacher_weight: {weights_line(e)}") from None
    fields = dict(fields, loss_chunk_size=0)
    student_vocab = plan.model.config.vocab_size
    if fields["vocab_size"] != student_vocab:
        raise ConfigError(f"--teacher_weight {path} has vocab_size {fields['vocab_size']}, the student "
                          f"{student_vocab}: distillation compares both models' token distributions, so pass a "
                          "teacher trained with the student's tokenizer")
    teacher_tokenizer = tokenizer_folder(path, plan)
    if teacher_tokenizer and not same_vocabulary(teacher_tokenizer, plan.data.tokenizer_path):
        raise ConfigError(f"--teacher_weight {path}: its tokenizer ({teacher_tokenizer}) differs from the "
                          f"student's ({plan.data.tokenizer_path}); pass a teacher trained with the student's "
                          "tokenizer")
    split = tp_validate(MiniMindConfig(**fields), plan.layout.tp)
    if split:
        raise ConfigError(f"--teacher_weight {path}: the teacher is split like the student: {split}")
    return fields


def tokenizer_folder(path, plan):
    """The tokenizer the teacher records (its sidecar, resume checkpoint or HF folder), to compare with the student's;
    None where it records none, where it is the student's (same tokenizer.json), or where it is not found here."""
    record = any_weights_record(path).get("tokenizer") or {}
    if record.get("sha256") and record["sha256"] == plan.data.tokenizer_record["sha256"]:
        return None
    return record["path"] if record.get("path") and os.path.isdir(record["path"]) else None


def same_vocabulary(folder, other):
    """Both tokenizer folders map the same strings to the same ids."""
    if os.path.realpath(folder) == os.path.realpath(other):
        return True
    return AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(other).get_vocab()


def build_teacher(stage, plan, dims):
    """The frozen teacher on plan.layout.device in the training dtype, eval mode, split like the student (tp, cp)."""
    teacher = MiniMindForCausalLM(stage.teacher_config)
    try:
        load_any_weights(teacher, stage.teacher_path)
    except WeightsError as e:
        raise ConfigError(f"--teacher_weight: {weights_line(e)}") from None
    teacher = teacher.to(plan.layout.device, dtype=plan.model.dtype).eval()
    if plan.layout.tp > 1:  # vocab-sharded logits, like the student's
        apply_tensor_parallel(teacher, dims.mesh("tp"), sequence_parallel=plan.layout.sequence_parallel)
    if plan.layout.cp > 1:
        apply_context_parallel(teacher, dims.mesh("cp"), doc_mask=plan.data.doc_mask)
    return teacher.requires_grad_(False)


class DistillationObjective(LMObjective):
    """alpha * CE + (1 - alpha) * T^2 * KL(teacher || student), summed over the target tokens / num_items.

    The teacher runs inside loss() on the same (context-sharded) inputs; stats: the CE and KL sums, logged as ce
    and kl (means over the step's target tokens)."""

    stat_names = ("ce_sum", "kl_sum")

    def __init__(self, teacher, stage):
        self.teacher, self.stage = teacher, stage

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        stage, teacher = self.stage, self.teacher
        if stage.chunk_size:
            with torch.no_grad():
                teacher_hidden = teacher.model(input_ids, position_ids=position_ids)[0]
            core, sums = getattr(model, "module", model), []  # DDP wraps the model; FSDP2 keeps it

            def chunked(module, args, output):  # inside the student's forward, where FSDP2 has gathered lm_head
                sums.extend(chunked_distillation(output[0], core.lm_head.weight, teacher_hidden,
                                                 teacher.lm_head.weight, targets, stage.alpha, stage.temperature,
                                                 stage.chunk_size))

            def as_output(module, args, output):  # a root output: ZeRO-3 gathers lm_head again before its backward
                output["loss"] = sums[0]
                return output
            handles = [core.model.register_forward_hook(chunked), core.register_forward_hook(as_output, prepend=True)]
            try:  # the root forward (DDP and FSDP2 hook it); its own lm_head sees one position only
                out = model(input_ids, position_ids=position_ids, logits_to_keep=1)
            finally:
                for handle in handles:
                    handle.remove()
            loss_sum, ce_sum, kl_sum = out.loss, sums[1], sums[2]
        else:  # full logits: --loss_chunk_size 0, or vocab-sharded under tensor parallel
            with torch.no_grad():
                teacher_logits = teacher(input_ids, position_ids=position_ids).logits
            out = model(input_ids, position_ids=position_ids)
            loss_sum, ce_sum, kl_sum = full_distillation(out.logits, teacher_logits, targets, stage.alpha,
                                                         stage.temperature)
        return loss_sum / num_items, out.aux_loss, dict(ce_sum=ce_sum, kl_sum=kl_sum)

    def pipeline_loss(self, logits, targets, extra, num_items):
        raise RuntimeError("distillation has no pipeline schedule: resolve_distillation refuses --pp > 1")

    def record(self, stats, num_items):
        return dict(ce=stats["ce_sum"] / num_items, kl=stats["kl_sum"] / num_items)

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The student's training FLOPs plus the teacher's forward (a third of its training FLOPs: 2 of 6 per
        weight, one of fwd+2 bwd for attention); its lm_head runs on target tokens only where the KL is chunked."""
        teacher = step_flops(self.stage.teacher_config, seq_len, positions, target_tokens, chunked_loss)
        return super().flops(config, seq_len, positions, target_tokens, chunked_loss) + teacher / 3


def describe(stage, plan, teacher):
    """The run's one line at start: where the student and the teacher come from, and the loss."""
    config = stage.teacher_config
    params = sum(p.numel() for p in teacher.parameters()) / 1e6  # a DTensor counts its full size
    return (f"Distillation: student from {plan.model.from_weight} (--from_weight; MiniMind's default full_sft: SFT -> "
            f"distillation), teacher {stage.teacher_path}{file_digest(stage.teacher_path)} ({params:.2f}M, hidden "
            f"{config.hidden_size}, {'MoE' if config.use_moe else 'dense'}), loss = {stage.alpha} * CE + "
            f"{1 - stage.alpha:g} * {stage.temperature}^2 * KL(teacher || student)")


class _DistillationChunks(CrossEntropyChunks):
    """loss_sum = alpha * ce_sum + (1 - alpha) * T^2 * kl_sum over chunks of rows (the loss of chunked_head): each
    chunk's teacher logits are formed beside the student's, so only one chunk's logits of each model exist at a time."""

    def __init__(self, teacher_hidden, teacher_weight, targets, chunk_size, alpha, temperature):
        super().__init__(targets, chunk_size)
        self.teacher_hidden, self.teacher_weight, self.alpha, self.temperature = (teacher_hidden, teacher_weight,
                                                                                  alpha, temperature)
        self.kl_sum = torch.zeros((), dtype=torch.float32, device=targets.device)

    def chunk(self, logits, start):
        """Adds the chunk's KL and CE; returns d(alpha CE + (1-alpha) T^2 KL)/d logits = alpha (softmax - one_hot) +
        (1-alpha) T (softmax(z/T) - p)."""
        temperature = self.temperature
        teacher_log_probs = F.linear(self.teacher_hidden[start:start + self.chunk_size], self.teacher_weight).float()
        teacher_log_probs = torch.log_softmax(teacher_log_probs.div_(temperature), dim=-1)
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        teacher_probs = teacher_log_probs.exp()
        # in place and as a dot product: no further chunk-sized temporaries
        self.kl_sum += torch.dot(teacher_probs.view(-1), teacher_log_probs.sub_(log_probs).view(-1))
        del teacher_log_probs
        grad_logits = log_probs.exp_().sub_(teacher_probs).mul_((1 - self.alpha) * temperature)
        del teacher_probs, log_probs
        return grad_logits.add_(super().chunk(logits, start), alpha=self.alpha)

    def total(self):
        return self.alpha * self.ce_sum + (1 - self.alpha) * self.temperature ** 2 * self.kl_sum


def chunked_distillation(hidden, weight, teacher_hidden, teacher_weight, targets, alpha, temperature, chunk_size):
    """(loss_sum, ce_sum, kl_sum) over targets != -100, from the two models' final hidden states and lm_head weights;
    only loss_sum has a gradient.

    hidden (..., H), teacher_hidden (..., H_t), targets (...); positions without a target are dropped first."""
    keep = (targets.reshape(-1) != -100).nonzero().squeeze(1)
    rows = [t.reshape(-1, t.shape[-1]).index_select(0, keep) for t in (hidden, teacher_hidden)]
    chunks = _DistillationChunks(rows[1].detach(), teacher_weight.detach(), targets.reshape(-1).index_select(0, keep),
                                 chunk_size, alpha, temperature)
    return chunked_head(rows[0], weight, chunks, chunk_size), chunks.ce_sum, chunks.kl_sum


def full_distillation(logits, teacher_logits, targets, alpha, temperature):
    """(loss_sum, ce_sum, kl_sum) from both models' full logits (B, L, V): the unchunked formula, also on
    vocab-sharded DTensor logits (tensor parallel, inside loss_parallel())."""
    logits, teacher_logits = logits.float(), teacher_logits.float().detach()
    ce_sum = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-100, reduction="sum")
    teacher_log_probs = log_softmax(teacher_logits / temperature)
    per_token = teacher_log_probs.exp() * (teacher_log_probs - log_softmax(logits / temperature))
    mask = (targets != -100).to(per_token.dtype)
    if isinstance(per_token, DTensor):  # the mask is the same on every tp rank
        mask = DTensor.from_local(mask, per_token.device_mesh, [Replicate()], run_check=False)
    kl_sum = (per_token.sum(-1) * mask).sum()
    ce_sum, kl_sum = replicated_sum(ce_sum), replicated_sum(kl_sum)
    return alpha * ce_sum + (1 - alpha) * temperature ** 2 * kl_sum, ce_sum.detach(), kl_sum.detach()


def replicated_sum(t):
    """A plain tensor of a (possibly partial) DTensor scalar: summed over tp ranks, autograd-aware."""
    return t.redistribute(t.device_mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t
