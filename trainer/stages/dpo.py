"""DPO (Rafailov et al.) and its family by --loss_type: the stage plan, the preference objective and the log-probs of
the targets.

sigmoid (the default): loss = -logsigmoid(beta * ((pc - rc) - (pr - rr))), averaged over the step's pairs, where pc / pr
are the policy's summed log-probs of the chosen / rejected assistant tokens (SFT's labels) and rc / rr the reference
model's; the other variants (ipo, hinge, robust, simpo, orpo) are rows of trainer/stages/dpo_losses.py's table.
A reference-free one (simpo, orpo) skips the reference model, its pass and its cache. The reference's sums are
computed once before training (trainer/stages/dpo_reference.py) and handed out with each pair (DPODataset). A run's
reference is fixed at its start: it is known by the content of its weights, and a resume keeps the run's reference
even where its file has since been overwritten (by this run's own saves, say), or refuses in one line.
"""
import os
from dataclasses import dataclass, replace

import torch

from dataset.mixture import leaf_datasets
from dataset.preference_data import DPODataset
from dataset.shards import local_part
from model.errors import ConfigError
from model.model_minimind import MiniMindForCausalLM
from model.provenance import content_sha256
from model.weights.flag_advice import mismatch_line, weights_line
from model.weights.paths import other_sizes, weight_path
from model.weights.shapes import WeightsError
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.ckpt.resume import check_resume_fields, saved_resume_fields
from trainer.ckpt.weights_file import read_any_weights
from trainer.core.batches import step_targets
from trainer.core.log_probs import sequence_log_probs, target_positions, token_log_probs
from trainer.core.shared_prefix import share_prefixes, unshare
from trainer.plan.model_config import flag_error
from trainer.plan.objective import LMObjective
from trainer.plan.stage import Stage
from trainer.stages.dpo_losses import LOSSES, LossParams, pair_losses
from trainer.stages.dpo_reference import attach_reference

DEFAULT_BETA = LOSSES["sigmoid"].beta  # MiniMind's train_dpo.py


@dataclass(frozen=True)
class DPOPlan(Stage):
    """The DPO stage's checked flags (trainer/plan/stage.py: chosen/rejected pairs, the preference objective)."""
    beta: float
    loss_type: str  # a row of dpo_losses.LOSSES
    label_smoothing: float
    simpo_gamma: float
    ref_weight: str  # the reference model's weights (a .pth, a step_<N> checkpoint, an HF folder), or "none"
    ref_sha256: str  # the run's reference by content: its weights' sha256 at the run's start ("seed N": the init)
    ref_changed: bool  # resuming, and ref_weight no longer holds the run's reference (its cached log-probs must do)
    name = "DPO"
    demo_kind = "dpo"
    rows_per_sample = 2  # a sample is a chosen/rejected pair: two model rows (pipeline stage shapes)
    has_eval = False  # it logs its rewards
    FLAGS = (
        Flag("loss_type", str, "sigmoid", "the preference loss (TRL's names): sigmoid (DPO), ipo, hinge, robust, "
             "simpo (no reference, length-normalised), orpo (no reference, SFT + odds ratio)", tuple(LOSSES)),
        Flag("beta", float, None, "beta: how far the policy may move from the reference (> 0; default by "
             "--loss_type: sigmoid 0.15 as MiniMind, simpo 2.0, the others 0.1 as TRL)"),
        Flag("label_smoothing", float, 0.0, "the share of pairs assumed mislabelled, in [0, 0.5) (sigmoid: "
             "conservative DPO; robust; simpo)"),
        Flag("simpo_gamma", float, 0.5, "SimPO's target reward margin gamma (--loss_type simpo)"),
        Flag("ref_weight", str, None, "the reference model: a weight prefix in save_dir, a .pth, a resume checkpoint "
             "step_<N> or an HF folder (default: the starting weights, --from_weight; none with simpo, orpo)"),
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
        loss_type = LOSSES[self.loss_type]
        Logger(f"DPO ({self.loss_type}) from --from_weight {plan.model.from_weight} (the SFT stage's output by "
               f"default), reference {self.ref_weight if loss_type.needs_reference else 'none needed'}, "
               f"beta {self.beta}")
        shared = plan.layout.pp == 1  # a pipeline's stages have fixed shapes: two rows of --max_seq_len
        objective = DPOObjective(self.beta, self.loss_type, self.label_smoothing, self.simpo_gamma,
                                 shared_prompt=shared, pad_token_id=leaf_datasets(train_ds)[0].pad_token_id,
                                 row_multiple=plan.row_multiple or 1, row_capacity=plan.data.seq_len)
        if loss_type.needs_reference:
            attach_reference(plan, dims, train_ds, objective)
        return objective

    def resume_fields(self):
        """The flags that shape the saved state (checked on resume, trainer/ckpt/resume.py)."""
        fields = {"--beta": self.beta, "--loss_type": self.loss_type, "--label_smoothing": self.label_smoothing,
                  "--simpo_gamma": self.simpo_gamma}
        if LOSSES[self.loss_type].needs_reference:
            fields["--ref_weight"] = {"path": self.ref_weight, "sha256": self.ref_sha256}
        return fields


def resolve_dpo(args, plan):
    """Check DPO's flags against the TrainPlan; ConfigError (one line) on bad input. A resume's checkpoint is checked
    here already (beta, loss, reference, tokenizer), before the reference log-probs are computed."""
    loss_type = LOSSES[args.loss_type]
    beta = loss_type.beta if args.beta is None else float(args.beta)
    if not beta > 0:
        note = f"MiniMind uses {DEFAULT_BETA}" if args.loss_type == "sigmoid" else f"TRL's is {loss_type.beta}"
        raise ConfigError(f"--beta must be > 0 ({note}), got {beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ConfigError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.label_smoothing and not loss_type.smoothing:
        raise ConfigError(f"--label_smoothing applies to --loss_type sigmoid, robust or simpo, not {args.loss_type}; "
                          "leave it out")
    if not loss_type.needs_reference and args.ref_weight is not None:
        raise ConfigError(f"--loss_type {args.loss_type} uses no reference model; leave out --ref_weight "
                          f"{args.ref_weight} (or pick a loss with one: sigmoid, ipo, hinge, robust)")
    check_pairs_layout(plan, "DPO")
    path, saved = saved_resume_fields(plan)
    reference = resolve_reference(args, plan, saved) if loss_type.needs_reference else ("none", "", False)
    stage = DPOPlan(beta=beta, loss_type=args.loss_type, label_smoothing=float(args.label_smoothing),
                    simpo_gamma=float(args.simpo_gamma), ref_weight=reference[0], ref_sha256=reference[1],
                    ref_changed=reference[2])
    check_resume_fields(saved, replace(plan, stage=stage), path)
    return stage


def check_pairs_layout(plan, name):
    """The layouts a stage of per-sequence log-prob sums runs in: no context parallelism, no packing."""
    if plan.layout.cp > 1:
        raise ConfigError(f"{name} does not run with --cp > 1 (its per-sequence log-prob sums would need a "
                          "context-parallel reduction); use --tp or --pp for long rows")
    if plan.data.packing:
        raise ConfigError(f"--packing 1: {name} keeps each conversation in its own row; leave it out")


def resolve_reference(args, plan, saved):
    """(--ref_weight's path, the run's reference by content, whether that file changed since the run started) from
    --ref_weight (default: --from_weight) and a resume's saved fields."""
    ref_weight = (plan.model.from_weight if args.ref_weight is None
                  else weight_path(args.ref_weight, plan.io.save_dir, plan.model.config))
    if ref_weight != "none" and not os.path.exists(ref_weight):
        raise ConfigError(f"--ref_weight {ref_weight} does not exist; {other_sizes(ref_weight, '--ref_weight')}"
                          "pass a .pth, a resume checkpoint step_<N> "
                          "directory or a Hugging Face folder")
    if ref_weight not in ("none", plan.model.from_weight):  # --from_weight's file was checked by resolve already
        check_reference(ref_weight, plan.model.config)
    sha = content_sha256(ref_weight) if ref_weight != "none" else f"seed {plan.data.seed}"
    was = (saved or {}).get("--ref_weight") or {}
    changed = bool(was) and was.get("sha256") != sha and was.get("path") == ref_weight  # overwritten since
    return ref_weight, was["sha256"] if changed else sha, changed


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


# ----------------------------------------------------------------------------- the objective

class DPOObjective(LMObjective):
    """The preference loss for trainer/core/loop.py's train_step (see trainer/plan/objective.py for the methods).

    shared_prompt: each pair's answers in one document, its prompt run once, pairs packed into rows of up to
    row_capacity tokens (unpack lays them out: trainer/core/shared_prefix.py); else its chosen and rejected rows
    adjacent."""

    items_are_tokens = False  # count() gives pairs

    def __init__(self, beta, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5, shared_prompt=False,
                 pad_token_id=0, row_multiple=1, row_capacity=0):
        self.loss_type, self.params = LOSSES[loss_type], LossParams(beta, label_smoothing, simpo_gamma)
        self.stat_names = ("chosen_reward_sum", "rejected_reward_sum", "accuracy_sum", "margin_sum",
                           *(f"{name}_sum" for name in self.loss_type.stats))
        self.shared_prompt, self.pad_token_id = shared_prompt, pad_token_id
        self.row_multiple, self.row_capacity = row_multiple, row_capacity
        self.positions_run = self.pairs_run = self.rows_run = 0  # the step's shared rows so far, for flops()

    def prepare(self, trainer, micro_batches):
        """The micro-batches as they come; the step's count of positions run starts (unpack adds to it)."""
        self.positions_run, self.pairs_run, self.rows_run = 0, 0, 0
        return micro_batches

    def unpack(self, batch):
        """Loader pairs (B, 2, L) -> shared rows (shared_prompt: (R, W) rows, their position ids, extra: (source,
        [reference (2B, 1)])) or (2B, L) rows, chosen and rejected of a pair adjacent (extra: ([reference (2B, 1)])).
        The reference's log-prob of each sequence rides along, so that a pipeline cuts it into micro-batches with the
        rows (none: a reference-free loss)."""
        input_ids, labels, *reference = batch
        reference = tuple(r.reshape(-1, 1) for r in reference)
        if not self.shared_prompt:
            return input_ids.flatten(0, 1), labels.flatten(0, 1), None, reference
        rows = share_prefixes(input_ids.flatten(0, 1), labels.flatten(0, 1), 2, self.pad_token_id, self.row_multiple,
                              self.row_capacity)
        self.positions_run += rows.input_ids.numel()
        self.pairs_run, self.rows_run = self.pairs_run + len(input_ids), self.rows_run + len(rows.input_ids)
        return rows.input_ids, rows.labels, rows.position_ids, (rows.source, *reference)

    def pair_losses(self, log_probs, targets, extra, lengths=None):
        """(loss sum, stats) of a micro-batch's sequences from their summed log-probs and their target counts (default:
        those of the rows `targets`) (dpo_losses.pair_losses)."""
        lengths = (targets != -100).sum(dim=1) if lengths is None else lengths
        reference = extra[-1] if self.loss_type.needs_reference else None
        return pair_losses(self.loss_type, self.params, log_probs, lengths, reference)

    def count(self, labels, extra):
        return (extra[0] if self.shared_prompt else labels).shape[0] // 2  # pairs

    def sequence_log_probs(self, model, input_ids, targets, position_ids=None, extra=()):
        """(summed log-probs (2B,) of each pair's chosen and rejected answer, adjacent; their target counts (2B,);
        the MoE aux loss) under `model` (a plain or tensor-parallel model); the lm_head on the positions with a
        target (target_positions)."""
        keep = target_positions(targets)
        out = model(input_ids, position_ids=position_ids, logits_to_keep=keep)
        if not self.shared_prompt:
            return sequence_log_probs(out.logits, targets[:, keep]), (targets != -100).sum(1), out.aux_loss
        source = extra[0]
        per_token = unshare(token_log_probs(out.logits, targets[:, keep]), source, targets.shape[1], keep)
        return per_token.sum(1), (source >= 0).sum(1), out.aux_loss

    def pair_log_probs(self, model, input_ids, labels, device):
        """(B, 2) summed log-probs of B pairs (input_ids, labels (B, 2, L), CPU) under `model` on `device`, laid out
        as training lays them out (the reference pass)."""
        x, y, position_ids, extra = self.unpack((input_ids, labels))
        x, targets, position_ids = (None if t is None else t.to(device) for t in (x, step_targets(y), position_ids))
        extra = tuple(t.to(device) for t in extra)
        return self.sequence_log_probs(model, x, targets, position_ids, extra)[0].view(-1, 2)

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        log_probs, lengths, aux_loss = self.sequence_log_probs(model, input_ids, targets, position_ids, extra)
        loss_sum, stats = self.pair_losses(log_probs, targets, extra, lengths)
        return loss_sum / num_items, aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        loss_sum, stats = self.pair_losses(sequence_log_probs(logits, targets), targets, extra)
        return loss_sum / num_items, stats

    def record(self, stats, num_items):
        """TRL's names: the mean rewards of the chosen and rejected answers, how often chosen wins, the margin."""
        pairs = max(num_items, 1)
        return {"rewards/chosen": stats["chosen_reward_sum"] / pairs,
                "rewards/rejected": stats["rejected_reward_sum"] / pairs,
                "rewards/accuracies": stats["accuracy_sum"] / pairs, "rewards/margins": stats["margin_sum"] / pairs,
                **{name: stats[f"{name}_sum"] / pairs for name in self.loss_type.stats}}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The model's training FLOPs on the positions run (shared rows: each prompt once), its lm_head on every
        position (on CPU it runs on the positions with a target only, target_positions: the MFU there reads a little
        high)."""
        if self.shared_prompt and self.pairs_run:  # the loop counts two rows of seq_len per pair
            seq_len, positions = (self.positions_run / self.rows_run,
                                  positions / seq_len / 2 * self.positions_run / self.pairs_run)
        return super().flops(config, seq_len, positions, target_tokens, False)
