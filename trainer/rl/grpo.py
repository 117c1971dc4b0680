"""GRPO (Shao et al., DeepSeekMath; TRL's GRPOTrainer): the stage plan, its checks and the objective.

Each step, `prepare` turns this rank's prompts into a rollout (trainer/rl/rollout.py: num_generations completions per
prompt, a prompt's group on one data-parallel rank), scores it (trainer/rl/rewards.py), normalises the rewards within
each group into advantages, and hands train_step micro-batches of completion rows (trainer/rl/rows.py). The loss
is a variant of trainer/rl/policy_loss.py's table (--loss_type: grpo, dapo, dr_grpo, bnpo, cispo, gspo, rloo), plus
beta KL_t with KL_t = exp(ref - log pi) - (ref - log pi) - 1 (k3) against the frozen reference (the starting
weights; none for beta 0). pi_old: the policy that generated (with num_iterations 1 the current one, detached: the
ratio is exactly 1); a rollout is trained on num_iterations steps in a row, its old log-probs taken by a forward of
the policy before the first of them.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.errors import ConfigError
from trainer.base.schema import Flag
from trainer.core.log_probs import target_positions
from trainer.core.shared_prefix import share_prefixes, unshare
from trainer.observe.metrics import step_flops
from trainer.plan.objective import target_tokens
from trainer.rl.base import (
    ROW_STATS,
    RolloutObjective,
    RolloutPlan,
    check_positions,
    engine_line,
    resolve_rollout,
    rewards_line,
)
from trainer.rl.policy_loss import LOSSES, GroupExtras, k3_kl, token_entropy
from trainer.rl.rows import scoring_log_probs, tempered_log_probs

GROUP_FLAGS = (  # GRPO's group-relative loss, which the agent stage trains with too; TRL's names
    Flag("num_generations", int, 6, "completions per prompt (a group, on one data-parallel rank)", min=2,
         hint="the advantages compare a prompt's completions with each other"),
    Flag("loss_type", str, "cispo", "policy loss, its ratio, normaliser and advantages (trainer/rl/policy_loss.py): "
         "TRL's grpo, dapo, dr_grpo, bnpo, cispo; gspo (TRL's importance_sampling_level sequence); rloo "
         "(leave-one-out advantages, TRL's RLOO ratio)",
         choices=tuple(LOSSES)),
    Flag("beta", float, 0.1, "weight of the k3 KL to the reference (the starting weights); 0 loads no reference"),
    Flag("epsilon", float, None, "lower clip of the ratio: 1 - epsilon (default: 3e-4 for gspo, 0.2 otherwise)"),
    Flag("epsilon_high", float, None, "upper clip of the ratio: 1 + epsilon_high (cispo: the ratio's cap; default: "
         "5.0 for cispo, 4e-4 for gspo, --epsilon otherwise)"),
    Flag("num_iterations", int, 1, "optimizer steps on each rollout (> 1: the ratio moves from 1 and clipping acts)",
         min=1),
)


@dataclass(frozen=True)
class GRPOPlan(RolloutPlan):
    """GRPO's checked flags: the shared rollout ones and the group loss's."""
    num_generations: int
    beta: float
    loss_type: str
    epsilon: float
    epsilon_high: float
    num_iterations: int
    name = "GRPO"
    FLAGS = RolloutPlan.FLAGS + GROUP_FLAGS

    @classmethod
    def resolve(cls, args, plan):
        return resolve_grpo(args, plan)

    @property
    def uses_reference(self):
        return self.beta > 0

    def rollout_objective(self, *parts):
        return GRPOObjective(self, *parts)

    def start_line(self, plan, objective):
        return describe(plan, objective)


def resolve_group(args):
    """The checked group-loss fields (GRPO's, the agent stage's) as a dict; ConfigError (one line) on bad input."""
    if not (math.isfinite(args.beta) and args.beta >= 0):
        raise ConfigError(f"--beta must be a non-negative number (got {args.beta})")
    variant = LOSSES[args.loss_type]
    epsilon = variant.epsilon if args.epsilon is None else args.epsilon
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else variant.epsilon_high or epsilon
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name} must be a positive number (got {value})")
    return dict(num_generations=args.num_generations, beta=float(args.beta), loss_type=args.loss_type,
                epsilon=float(epsilon), epsilon_high=float(epsilon_high), num_iterations=args.num_iterations)


def resolve_grpo(args, plan):
    """Check GRPO's flags against the TrainPlan; ConfigError (one line) on bad input."""
    group = resolve_group(args)
    stage = GRPOPlan(**resolve_rollout(args, plan, "GRPO"), **group)
    check_positions(stage.row_length, plan, "--max_seq_len + --max_gen_len")
    return stage


def describe(plan, objective, name="GRPO"):
    """The run's line at start: start weights, groups, loss, reference, rewards, rollout engine."""
    stage = plan.stage
    line = (f"{name} from --from_weight {plan.model.from_weight}: {stage.num_generations} completions per prompt "
            f"(up to {stage.max_gen_len} tokens, temperature {stage.temperature}, top_p {stage.top_p}, "
            f"{engine_line(stage)}), loss {stage.loss_type} (epsilon {stage.epsilon}, epsilon_high "
            f"{stage.epsilon_high}), beta {stage.beta}"
            f"{' (reference: the starting weights)' if stage.beta else ''}; rewards: {rewards_line(objective)}")
    if stage.num_iterations > 1:
        line += (f"; each rollout trains {stage.num_iterations} steps: the prompt batches drawn in the steps between "
                 f"are not generated from (an epoch uses 1 in {stage.num_iterations})")
    return line


class GRPOObjective(RolloutObjective):
    """The GRPO loss for train_step (see trainer/plan/objective.py); `prepare` makes the step's rollout."""

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        super().__init__(stage, plan, dims, engine, tokenizer, functions, weights, reference)
        self.variant = LOSSES[stage.loss_type]
        self.advantages_of = self.variant.advantages
        self.items_are_tokens = self.variant.normaliser.items is target_tokens
        # the extras each micro-batch carries, by name: the others are absent (None) under these flags
        self.shared_prompt = plan.layout.pp == 1  # a pipeline's stages have fixed shapes: a row per completion
        self.extra_fields = ("advantages", "row_stats", *(("reference",) if stage.beta else ()),
                             *(("old_log_probs",) if stage.num_iterations > 1 else ()))
        self.row_stat_names = (*ROW_STATS, *(f"rewards/{n}" for n in self.reward_names))  # the row stats' columns
        self.stat_names = ("rows", "tokens", *self.row_stat_names, "entropy_sum", *self.variant.clips.stats,
                           *(("kl_sum",) if stage.beta else ()))

    # ------------------------------------------------------------------ the step's micro-batches
    def prepare(self, trainer, micro_batches):
        """Roll out this step's prompts (or reuse the last rollout within its num_iterations) into micro-batches
        (input_ids, labels, GroupExtras) of completion rows."""
        step = trainer.progress.global_step
        if self.buffer is None or step % self.stage.num_iterations == 0:
            self.buffer = self.roll_out(trainer, micro_batches, step)
        self.reused_next = (step + 1) % self.stage.num_iterations != 0  # the next step trains on this rollout too
        # the positions the step runs: its rows', or their shared rows' (unpack adds them)
        self.trained_positions = 0 if self.shared_prompt else sum(ids.numel() for ids, _, _ in self.buffer)
        return self.buffer

    def roll_out(self, trainer, micro_batches, step):
        stage, plan = self.stage, self.plan
        rolled = self.roll_out_rows(trainer, micro_batches, step)
        rows = [row for row, _, _ in rolled]
        none = [None] * len(rows)
        share = self.shared_rows if self.shared_prompt else None  # scored in the layout the loss runs
        reference = (scoring_log_probs(*self.reference, rows, plan, stage.temperature, share) if stage.beta
                     else none)
        # the generating policy's log-probs, for the ratio of the later iterations
        old = (scoring_log_probs(trainer.model_parts, trainer.pipeline, rows, plan, stage.temperature, share)
               if stage.num_iterations > 1 else none)
        batches = [(ids, labels, GroupExtras(advantages[:, None], row_stats, ref, old_log_probs))
                   for ((ids, labels), advantages, row_stats), ref, old_log_probs in zip(rolled, reference, old)]
        return batches

    def unpack(self, batch):
        """The micro-batch's present extras only (a pipeline schedule carries tensors, never None). Shared rows (no
        pipeline): each prompt's completions in one row, the prompt run once (trainer/core/shared_prefix.py), with
        their position ids and `source` first among the extras, which stay per completion."""
        input_ids, labels, extra = batch
        extra = tuple(t for t in extra if t is not None)
        if not self.shared_prompt:
            return input_ids, labels, None, extra
        rows = self.shared_rows(input_ids, labels)
        self.trained_positions += rows.input_ids.numel()
        return rows.input_ids, rows.labels, rows.position_ids, (rows.source, *extra)

    def shared_rows(self, input_ids, labels):
        """Rows (N, L) of prompt + completion as SharedRows: a prompt's completions in one row."""
        return share_prefixes(input_ids, labels, self.stage.num_generations, self.tokenizer.pad_token_id)

    def count(self, labels, extra):
        """This micro-batch's share of the step's normaliser: completion tokens (dapo, cispo), completions (grpo,
        dr_grpo, gspo, rloo) or one micro-batch (bnpo); of shared rows, from each completion's targets (source)."""
        if self.shared_prompt:  # labels (N, L) that mark each completion's targets where its own row had them
            labels = F.pad(torch.where(extra[0] >= 0, 0, -100), (1, 0), value=-100)[:, :-1]
        return self.variant.normaliser.items(labels)

    # ------------------------------------------------------------------ the loss
    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        """The policy loss on the logits of the positions with a scored token (target_positions): a prompt's logits
        are never read; the per-token extras cut alike (shared rows: the log-probs and entropies
        gathered back to each completion's own positions instead)."""
        keep = target_positions(targets)
        out = model(input_ids, position_ids=position_ids, logits_to_keep=keep)
        temperature = self.stage.temperature
        if self.shared_prompt:
            source, extra = extra[0], GroupExtras.of(extra[1:], self.extra_fields)
            log_probs = unshare(tempered_log_probs(out.logits, targets[:, keep], temperature), source,
                                targets.shape[1], keep)
            entropy = unshare(token_entropy(out.logits, temperature), source, targets.shape[1], keep)
            main, stats = self.policy_terms(log_probs, entropy, (source >= 0).float(), extra, num_items)
            return main, out.aux_loss, stats
        extra = GroupExtras.of(extra, self.extra_fields)
        extra = extra._replace(**{name: getattr(extra, name)[:, keep] for name in ("reference", "old_log_probs")
                                  if getattr(extra, name) is not None})
        main, stats = self.policy_loss(out.logits, targets[:, keep], extra, num_items)
        return main, out.aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        return self.policy_loss(logits, targets, extra, num_items)

    def policy_loss(self, logits, targets, extra, num_items):
        """(this micro-batch's share of the step's loss, stats) from the policy's logits (N, L, V)."""
        temperature = self.stage.temperature
        return self.policy_terms(tempered_log_probs(logits, targets, temperature), token_entropy(logits, temperature),
                                 (targets != -100).float(), extra, num_items)

    def policy_terms(self, log_probs, entropy, mask, extra, num_items):
        """(loss share, stats) from the targets' log-probs (N, L), the entropies there and their mask."""
        stage, variant = self.stage, self.variant
        extra = GroupExtras.of(extra, self.extra_fields)
        old = extra.old_log_probs if extra.old_log_probs is not None else log_probs.detach()
        ratio = variant.ratio(log_probs, old, mask)
        per_token = variant.surrogate(ratio, extra.advantages, log_probs, stage.epsilon, stage.epsilon_high)
        if stage.beta:
            kl = k3_kl(extra.reference, log_probs)
            per_token = per_token + stage.beta * kl
        loss = variant.normaliser.reduce(per_token * mask, mask, num_items, stage.max_gen_len)
        stats = dict(rows=torch.tensor(float(mask.shape[0])), tokens=mask.sum().detach(),
                     entropy_sum=(entropy * mask).sum())
        stats.update(zip(self.row_stat_names, extra.row_stats.sum(0)))
        weight = torch.ones_like(ratio) if variant.sequence_ratio else mask  # a sequence ratio counts completions
        stats.update(variant.clips.sums(ratio.detach(), extra.advantages, weight, stage.epsilon, stage.epsilon_high))
        if stage.beta:
            stats["kl_sum"] = (kl.detach() * mask).sum()
        return loss, stats

    # ------------------------------------------------------------------ records
    def record(self, stats, num_items):
        """TRL's metric names, plus this process's rollout speed and its share of the wall time since the last
        record."""
        out = self.row_record(stats)
        tokens = max(stats["tokens"], 1.0)
        out["entropy"] = stats["entropy_sum"] / tokens
        if self.stage.beta:
            out["kl"] = stats["kl_sum"] / tokens
        clipped_of = max(stats["rows"], 1.0) if self.variant.sequence_ratio else tokens  # TRL's: per completion
        for stat, record in zip(self.variant.clips.stats, self.variant.clips.records):
            out[record] = stats[stat] / clipped_of
        return {**out, **self.rollout_record()}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The policy's training FLOPs and the reference's forward (a third) on the rows as trained: the loop counts
        every row at the full row length, this rank's rows (as for the others) are as long as their completions;
        lm_head on every position."""
        rows = self.plan.micro_batch_shape[0] * self.plan.data.num_microbatches
        row_length = self.trained_positions / max(1, rows)
        train = step_flops(config, row_length, positions * row_length / seq_len, target_tokens, False)
        return train * (1 + (1 / 3 if self.stage.beta else 0))
