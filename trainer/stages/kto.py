"""KTO (TRL's KTOTrainer, arXiv 2402.01306): unpaired rows, each answer labelled desirable or not, against a frozen
reference model.

With r = log pi(y|x) - log ref(y|x) (summed over the answer's tokens, SFT's labels) and z0 the KL baseline:
  desirable rows    w_d (1 - sigmoid(beta (r - z0)))
  undesirable rows  w_u (1 - sigmoid(beta (z0 - r)))
averaged over the step's rows. z0 is estimated as TRL does, from mismatched pairs: each row's prompt with another
row's answer (its KL row, dataset/preference_data.KTODataset), z0 = max(0, mean over the step's KL rows of
log pi - log ref), detached. TRL mismatches within a micro-batch; here the partner is fixed by the file (the next row)
and z0 is taken over the whole step on every rank, so that it is the same in every layout and the KL rows' reference
log-probs are cached with the rows' (trainer/stages/dpo_reference.py, as DPO's). Each step runs one no-grad forward
of the KL rows first (`prepare`), then trains on the rows themselves.
"""
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dataset.preference_data import KTODataset
from dataset.shards import local_part
from model.errors import ConfigError
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.ckpt.resume import check_resume_fields, saved_resume_fields
from trainer.core.batches import step_targets
from trainer.core.log_probs import sequence_log_probs, target_positions
from trainer.plan.objective import LMObjective
from trainer.plan.stage import Stage
from trainer.stages.dpo import check_pairs_layout, resolve_reference
from trainer.stages.dpo_reference import attach_reference, forward_log_probs


@dataclass(frozen=True)
class KTOPlan(Stage):
    """KTO's checked flags (trainer/plan/stage.py): unpaired labelled rows, the reference as DPO's."""
    beta: float
    desirable_weight: float
    undesirable_weight: float
    ref_weight: str  # as DPOPlan's: the reference's weights, its content hash, whether its file changed since
    ref_sha256: str
    ref_changed: bool
    name = "KTO"
    demo_kind = "kto"
    rows_per_sample = 2  # a row and its KL row
    has_eval = False  # it logs its rewards and KL
    FLAGS = (
        Flag("beta", float, 0.1, "KTO's beta: how far the policy may move from the reference (> 0; TRL's 0.1)"),
        Flag("desirable_weight", float, 1.0, "weight of the desirable rows' losses (> 0; TRL: keep "
             "desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3])"),
        Flag("undesirable_weight", float, 1.0, "weight of the undesirable rows' losses (> 0)"),
        Flag("ref_weight", str, None, "the reference model: a weight prefix in save_dir, a .pth, a resume checkpoint "
             "step_<N> or an HF folder (default: the starting weights, --from_weight)"),
    )

    @classmethod
    def resolve(cls, args, plan):
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            if not getattr(args, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(args, name)}")
        check_pairs_layout(plan, "KTO")
        if plan.layout.pp > 1:
            raise ConfigError("KTO does not run with --pp > 1 (its KL baseline is a forward before the step's); use "
                              "--tp or --zero_stage 3 for a large model")
        path, saved = saved_resume_fields(plan)
        ref_weight, sha, changed = resolve_reference(args, plan, saved)
        stage = cls(beta=float(args.beta), desirable_weight=float(args.desirable_weight),
                    undesirable_weight=float(args.undesirable_weight), ref_weight=ref_weight, ref_sha256=sha,
                    ref_changed=changed)
        check_resume_fields(saved, replace(plan, stage=stage), path)
        return stage

    def dataset(self, plan, tokenizer, path):
        """Unpaired chat rows with a "label" (KTODataset), each with its KL row."""
        return KTODataset(path, tokenizer, max_length=plan.data.seq_len, skip_bad_lines=plan.data.skip_bad_lines,
                          cache_dir=plan.data.cache_dir, num_proc=plan.data.num_proc, part=local_part())

    def objective(self, plan, dims, train_ds):
        Logger(f"KTO from --from_weight {plan.model.from_weight}, reference {self.ref_weight}, beta {self.beta}, "
               f"desirable_weight {self.desirable_weight}, undesirable_weight {self.undesirable_weight}")
        objective = KTOObjective(self.beta, self.desirable_weight, self.undesirable_weight)
        attach_reference(plan, dims, train_ds, objective)  # the rows' and their KL rows' reference log-probs
        return objective

    def resume_fields(self):
        return {"--beta": self.beta, "--desirable_weight": self.desirable_weight,
                "--undesirable_weight": self.undesirable_weight,
                "--ref_weight": {"path": self.ref_weight, "sha256": self.ref_sha256}}


def kto_losses(log_ratios, desirable, kl, beta, desirable_weight, undesirable_weight):
    """(loss sum, stats) of rows with log-ratios r (N,), desirable flags (N,) and the KL baseline kl (a scalar)."""
    wanted = desirable > 0.5
    losses = torch.where(wanted, desirable_weight * (1 - torch.sigmoid(beta * (log_ratios - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - log_ratios))))
    rewards, wanted = beta * log_ratios.detach(), wanted.float()
    stats = {"chosen_reward_sum": (rewards * wanted).sum(), "chosen_count": wanted.sum(),
             "rejected_reward_sum": (rewards * (1 - wanted)).sum(), "rejected_count": (1 - wanted).sum()}
    return losses.sum(), stats


class KTOObjective(LMObjective):
    """KTO's loss for train_step (see trainer/plan/objective.py); `prepare` estimates the step's KL baseline."""

    stat_names = ("chosen_reward_sum", "chosen_count", "rejected_reward_sum", "rejected_count")
    items_are_tokens = False  # count() gives rows

    def __init__(self, beta, desirable_weight, undesirable_weight):
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.kl = None

    def log_probs(self, model, input_ids, targets, position_ids=None):
        """Summed log-probs of each row's targets under `model` (the reference pass calls it too)."""
        keep = target_positions(targets)  # the lm_head on the positions with a target
        out = model(input_ids, position_ids=position_ids, logits_to_keep=keep)
        return sequence_log_probs(out.logits, targets[:, keep]), out.aux_loss

    def pair_log_probs(self, model, input_ids, labels, device):
        """(B, 2) summed log-probs of each item's row and KL row (input_ids, labels (B, 2, L), CPU) under `model` on
        `device`: the reference pass."""
        targets = step_targets(labels.flatten(0, 1)).to(device)
        return self.log_probs(model, input_ids.flatten(0, 1).to(device), targets)[0].view(-1, 2)

    def prepare(self, trainer, micro_batches):
        """z0 = max(0, mean of log pi - log ref over the step's KL rows on every rank), no grad; then the
        micro-batches of the rows themselves: (input_ids, labels, desirable, reference)."""
        plan, device = trainer.plan, trainer.plan.layout.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        rows = []
        for input_ids, labels, desirable, reference in micro_batches:
            ids, targets = input_ids[:, 1].to(device), step_targets(labels[:, 1]).to(device)
            with torch.no_grad():
                policy = forward_log_probs(trainer.model_parts, None, ids, targets, plan, self)
            ratio_sum = (policy.double() - reference[:, 1].to(device).double()).sum()
            total += torch.stack([ratio_sum, torch.tensor(float(len(ids)), dtype=torch.float64, device=device)])
            rows.append((input_ids[:, 0], labels[:, 0], desirable, reference[:, 0]))
        if dist.is_initialized():
            dist.all_reduce(total)  # tensor-parallel replicas add the same rows to both sums: the mean is unchanged
        self.kl = (total[0] / total[1]).clamp(min=0).float()
        return rows

    def unpack(self, batch):
        """(input_ids, labels) of the rows; extra: the reference's log-prob and the desirable flag of each, (N, 1)."""
        input_ids, labels, desirable, reference = batch
        return input_ids, labels, None, (reference.reshape(-1, 1), desirable.reshape(-1, 1))

    def count(self, labels, extra):
        return labels.shape[0]  # rows

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        log_probs, aux_loss = self.log_probs(model, input_ids, targets, position_ids)
        reference, desirable = extra
        loss_sum, stats = kto_losses(log_probs.float() - reference.view(-1).float(), desirable.view(-1), self.kl,
                                     self.beta, self.desirable_weight, self.undesirable_weight)
        return loss_sum / num_items, aux_loss, stats

    def record(self, stats, num_items):
        """TRL's names: the mean rewards of the desirable and undesirable rows, their gap, the KL baseline; a side
        with no row in the step has no mean (and no gap), not a 0.0."""
        out = {}
        for side in ("chosen", "rejected"):
            if stats[f"{side}_count"] > 0:
                out[f"rewards/{side}"] = stats[f"{side}_reward_sum"] / stats[f"{side}_count"]
        if len(out) == 2:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return dict(out, kl=float(self.kl))

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The rows' training FLOPs, the LM head on every position, plus the KL rows' forward (a third of it)."""
        return super().flops(config, seq_len, positions, target_tokens, False) * 4 / 3
