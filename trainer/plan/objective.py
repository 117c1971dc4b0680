"""What a stage minimises, seen by the one shared train_step and by evaluate(): LMObjective, the base every stage's
objective subclasses, and the objective of pretraining, SFT and LoRA.

A stage's objective (trainer/plan/stage.py: Stage.objective makes it) overrides what differs; the loop, the layouts,
checkpoints and tracking stay the same. Every method but `record` runs without a host sync: counts come from CPU
tensors, stats stay on the device until a log step.
"""
import torch.nn.functional as F

from trainer.observe.metrics import step_flops


class LMObjective:
    """The mean next-token cross-entropy over the step's target tokens (labels != -100), plus the MoE aux loss."""

    stat_names = ()  # the names of the stats loss() returns, summed over ranks at log steps (fixed: a collective)
    items_are_tokens = True  # count() gives target tokens (else train_step counts them for tokens/s and MFU)

    def prepare(self, trainer, micro_batches):
        """The step's micro-batches from the loader's, first thing in the step: the one hook for inputs that depend on
        the current model (GRPO's rollout); LM, DPO and distillation train on the loader's as they are."""
        return micro_batches

    def unpack(self, batch):
        """A loader batch -> (input_ids, labels, position_ids or None, extra): CPU tensors.

        position_ids come with packed rows under --doc_mask (a third tensor); LM needs no extra."""
        return batch[0], batch[1], batch[2] if len(batch) > 2 else None, ()

    def count(self, labels, extra):
        """This rank's share of the step's denominator, from the CPU labels: its target tokens."""
        return target_tokens(labels)

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        """(CE sum / num_items, the MoE aux loss, stats) of one micro-batch; the model forms the (chunked) CE."""
        out = model(input_ids, position_ids=position_ids, shift_labels=targets, num_items_in_batch=num_items)
        return out.loss, out.aux_loss, {}

    def pipeline_loss(self, logits, targets, extra, num_items):
        """The same on the last pipeline stage's logits: (CE sum / num_items, stats)."""
        return cross_entropy_sum(logits, targets) / num_items, {}

    def eval_loss(self, model, input_ids, targets, position_ids, extra):
        """A held-out micro-batch's summed loss (no grad); eval_loss is its sum over the eval batches / their count()s:
        the CE sum, the model's own (a stage with no held-out metric says so: Stage.has_eval)."""
        return model(input_ids, position_ids=position_ids, shift_labels=targets, num_items_in_batch=1).loss

    def eval_pipeline_loss(self, logits, targets):
        """The same on the last pipeline stage's logits, shape (1,): what the forward-only schedule collects."""
        return cross_entropy_sum(logits, targets).reshape(1)

    def record(self, stats, num_items):
        """Extra values for a log step's record, from `stats` summed over micro-batches and ranks: none for LM."""
        return {}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The FLOPs MFU counts for a step of `positions` input positions: the model's training FLOPs."""
        return step_flops(config, seq_len, positions, target_tokens, chunked_loss)

    def state_dict(self):
        """This rank's objective state a resume needs (saved per rank beside the RNG; {}: none, nothing written)."""
        return {}

    def load_state_dict(self, state):
        """Restore what state_dict() returned."""


def cross_entropy_sum(logits, targets):
    """The summed CE (fp32) of logits (..., V) over targets != -100."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")


def target_tokens(labels):
    """The target tokens of CPU labels (B, L): labels[:, 1:] != -100 (a row's first label has no input before it)."""
    return int((labels[:, 1:] != -100).sum())

