"""DPO (sigmoid, Rafailov et al.): the stage plan, the preference objective and the log-probs of the targets.

loss = -logsigmoid(beta * ((pc - rc) - (pr - rr))), averaged over the step's pairs, where pc / pr are the policy's
summed log-probs of the chosen / rejected assistant tokens (SFT's labels) and rc / rr the reference model's.
The reference's sums are computed once before training (trainer/stages/dpo_reference.py) and handed out with each pair
(dataset/lm_dataset.py DPODataset). A run's reference is fixed at its start: it is known by the content of its
weights, and a resume keeps the run's reference even where its file has since been overwritten (by this run's own
saves, say), or refuses in one line.
"""
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dataset.lm_dataset import DPODataset
from dataset.token_cache import local_part
from model.model_minimind import MiniMindForCausalLM
from model.provenance import content_sha256
from model.weight_shapes import WeightsError
from trainer.ckpt.checkpoint import saved_resume_fields
from trainer.ckpt.resume_fields import check_resume_fields
from trainer.ckpt.weight_flags import mismatch_line, weights_line
from trainer.ckpt.weights_file import read_any_weights
from trainer.core.log_probs import sequence_log_probs
from trainer.core.objective import LMObjective
from trainer.core.stage import Stage
from trainer.plan.checks import other_sizes
from trainer.plan.model_config import flag_error
from trainer.plan.resolve import weight_path
from trainer.plan.schema import Flag
from trainer.runtime.launch import ConfigError
from trainer.stages.dpo_reference import attach_reference
from trainer.trainer_utils import Logger

DEFAULT_BETA = 0.15  # MiniMind's train_dpo.py


@dataclass(frozen=True)
class DPOPlan(Stage):
    """The DPO stage's checked flags (trainer/core/stage.py: chosen/rejected pairs, the preference objective)."""
    beta: float
    ref_weight: str  # the reference model's weights (a .pth, a step_<N> checkpoint, an HF folder), or "none"
    ref_sha256: str  # the run's reference by content: its weights' sha256 at the run's start ("seed N": the init)
    ref_changed: bool  # resuming, and ref_weight no longer holds the run's reference (its cached log-probs must do)
    name = "DPO"
    demo_kind = "dpo"
    rows_per_sample = 2  # a sample is a chosen/rejected pair: two model rows (pipeline stage shapes)
    has_eval = False  # it logs its rewards
    FLAGS = (
        Flag("beta", float, DEFAULT_BETA, "DPO's beta: how far the policy may move from the reference (> 0)"),
        Flag("ref_weight", str, None, "the reference model: a weight prefix in save_dir, a .pth, a resume checkpoint "
             "step_<N> or an HF folder (default: the starting weights, --from_weight)"),
    )

    @classmethod
    def resolve(cls, args, plan):
        return resolve_dpo(args, plan)

    def dataset(self, plan, tokenizer, path):
        """Chosen/rejected chat pairs (DPODataset), each conversation in its own row."""
        return DPODataset(path, tokenizer, max_length=plan.data.seq_len, skip_bad_lines=plan.data.skip_bad_lines,
                          cache_dir=plan.data.cache_dir, num_proc=plan.data.num_proc, part=local_part())

    def objective(self, plan, dims, train_ds):
        """The preference loss, after the reference model's log-probs of every pair: cached, or computed in this
        layout by the reference (loaded alone, then dropped)."""
        Logger(f"DPO from --from_weight {plan.model.from_weight} (the SFT stage's output by default), "
               f"reference {self.ref_weight}, beta {self.beta}")
        objective = DPOObjective(self.beta)
        attach_reference(plan, dims, train_ds, objective)
        return objective

    def resume_fields(self):
        """The flags that shape the saved state (checked on resume, trainer/ckpt/resume_fields.py)."""
        return {"--beta": self.beta, "--ref_weight": {"path": self.ref_weight, "sha256": self.ref_sha256}}


def resolve_dpo(args, plan):
    """Check DPO's flags against the TrainPlan; ConfigError (one line) on bad input. A resume's checkpoint is checked
    here already (beta, reference, tokenizer), before the reference log-probs are computed."""
    if not args.beta > 0:
        raise ConfigError(f"--beta must be > 0 (MiniMind uses {DEFAULT_BETA}), got {args.beta}")
    if plan.layout.cp > 1:
        raise ConfigError("DPO does not run with --cp > 1 (its per-sequence log-prob sums would need a "
                          "context-parallel reduction); use --tp or --pp for long rows")
    if plan.data.packing:
        raise ConfigError("--packing 1: DPO keeps each chosen/rejected conversation in its own row; leave it out")
    ref_weight = (plan.model.from_weight if args.ref_weight is None
                  else weight_path(args.ref_weight, plan.io.save_dir, plan.model.config))
    if ref_weight != "none" and not os.path.exists(ref_weight):
        raise ConfigError(f"--ref_weight {ref_weight} does not exist; {other_sizes(ref_weight, '--ref_weight')}"
                          "pass a .pth, a resume checkpoint step_<N> "
                          "directory or a Hugging Face folder")
    if ref_weight not in ("none", plan.model.from_weight):  # --from_weight's file was checked by resolve already
        check_reference(ref_weight, plan.model.config)
    sha = content_sha256(ref_weight) if ref_weight != "none" else f"seed {plan.data.seed}"
    path, saved = saved_resume_fields(plan)
    was = (saved or {}).get("--ref_weight") or {}
    changed = bool(was) and was.get("sha256") != sha and was.get("path") == ref_weight  # overwritten since
    stage = DPOPlan(beta=float(args.beta), ref_weight=ref_weight, ref_sha256=was["sha256"] if changed else sha,
                    ref_changed=changed)
    check_resume_fields(saved, replace(plan, stage=stage), path)
    return stage


def check_reference(path, config):
    """The reference weights fit the policy's model: one line naming --ref_weight and the file otherwise."""
    try:
        state_dict, _, _ = read_any_weights(path)
        with torch.device("meta"):
            message = mismatch_line(state_dict, MiniMindForCausalLM(config), path)
    except WeightsError as e:
        message = weights_line(e)
    if message:
        raise ConfigError(flag_error("--ref_weight", path, message))


def pair_losses(log_probs, reference, beta):
    """Per-pair DPO losses and reward sums from policy log-probs (2B,) (pairs interleaved, chosen first) and
    the reference's (B, 2). Returns (loss sum, stats: sums of TRL's rewards/* over the pairs, detached)."""
    policy = log_probs.float().view(-1, 2)
    rewards = beta * (policy - reference.float().view(-1, 2))  # TRL's rewards/chosen, rewards/rejected
    margins = rewards[:, 0] - rewards[:, 1]
    losses = -F.logsigmoid(margins)
    detached = rewards.detach()
    stats = {"chosen_reward_sum": detached[:, 0].sum(), "rejected_reward_sum": detached[:, 1].sum(),
             "accuracy_sum": (margins.detach() > 0).float().sum(), "margin_sum": margins.detach().sum()}
    return losses.sum(), stats


# ----------------------------------------------------------------------------- the objective

class DPOObjective(LMObjective):
    """The preference loss for trainer/core/loop.py's train_step (see trainer/core/objective.py for the methods)."""

    stat_names = ("chosen_reward_sum", "rejected_reward_sum", "accuracy_sum", "margin_sum")
    items_are_tokens = False  # count() gives pairs

    def __init__(self, beta):
        self.beta = beta

    def unpack(self, batch):
        """(B, 2, L) pairs -> (2B, L) rows, chosen and rejected of a pair adjacent; extra: the reference's log-prob of
        each row (2B, 1), so that a pipeline cuts it into micro-batches with the rows."""
        input_ids, labels, reference = batch
        return input_ids.flatten(0, 1), labels.flatten(0, 1), None, (reference.reshape(-1, 1),)

    def count(self, labels, extra):
        return labels.shape[0] // 2  # pairs

    def log_probs(self, model, input_ids, targets, position_ids=None):
        """Summed log-probs of each row's targets under `model` (a plain or tensor-parallel model)."""
        out = model(input_ids, position_ids=position_ids)
        return sequence_log_probs(out.logits, targets), out.aux_loss

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        log_probs, aux_loss = self.log_probs(model, input_ids, targets, position_ids)
        loss_sum, stats = pair_losses(log_probs, extra[0], self.beta)
        return loss_sum / num_items, aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        loss_sum, stats = pair_losses(sequence_log_probs(logits, targets), extra[0], self.beta)
        return loss_sum / num_items, stats

    def record(self, stats, num_items):
        """TRL's names: the mean rewards of the chosen and rejected answers, how often chosen wins, the margin."""
        pairs = max(num_items, 1)
        return {"rewards/chosen": stats["chosen_reward_sum"] / pairs,
                "rewards/rejected": stats["rejected_reward_sum"] / pairs,
                "rewards/accuracies": stats["accuracy_sum"] / pairs, "rewards/margins": stats["margin_sum"] / pairs}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The model's training FLOPs, its lm_head on every position: the log-probs come from the full logits."""
        return super().flops(config, seq_len, positions, target_tokens, False)
