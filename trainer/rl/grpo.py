"""GRPO (Shao et al., DeepSeekMath; TRL's GRPOTrainer): the stage plan, its checks and the objective.

Each step, `prepare` turns this rank's prompts into a rollout (trainer/rl/rollout.py: num_generations completions per
prompt, a prompt's group on one data-parallel rank), scores it (trainer/rl/rewards.py), normalises the rewards within
each group into advantages, and hands train_step micro-batches of completion rows (trainer/rl/rows.py). The loss
of each completion token t of row i, with ratio r = pi(t) / pi_old(t) at the sampling temperature:
  grpo, dapo, dr_grpo, bnpo:  -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_t
  cispo:                      -sg(min(r, epsilon_high)) A_i log pi(t) + beta KL_t
KL_t = exp(ref - log pi) - (ref - log pi) - 1 (k3) against the frozen reference (the starting weights; none for
beta 0). Normalisers, TRL's: grpo the mean over completions of each one's token mean; bnpo the mean over
micro-batches of each one's token mean; dr_grpo the sum over rows / (rows x max_gen_len); dapo and cispo the sum
over the step's completion tokens / their number. pi_old: the policy that generated (with num_iterations 1 the
current one, detached: the ratio is exactly 1); a rollout is trained on num_iterations steps in a row, its old
log-probs taken by a forward of the policy before the first of them.
"""
import math
from dataclasses import dataclass

import torch

from trainer.core.objective import target_tokens
from trainer.plan.schema import Flag
from trainer.rl.base import (
    ROW_STATS,
    RolloutObjective,
    RolloutPlan,
    check_positions,
    check_positive,
    engine_line,
    resolve_rollout,
    rewards_line,
)
from trainer.rl.policy_loss import clip_stats, k3_kl, normalised, token_entropy
from trainer.rl.rows import scoring_log_probs, tempered_log_probs
from trainer.runtime.launch import ConfigError
from trainer.runtime.metrics import step_flops

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo")
TOKEN_LOSSES = ("dapo", "cispo")  # normalised by the step's completion tokens
CISPO_EPSILON_HIGH = 5.0  # MiniMind's --epsilon_high for cispo; the clipping losses default to --epsilon (TRL)


GROUP_FLAGS = (  # GRPO's group-relative loss, which the agent stage trains with too; TRL's names
    Flag("num_generations", int, 6, "completions per prompt (a group, on one data-parallel rank)"),
    Flag("loss_type", str, "cispo", "policy loss and its normaliser, as TRL defines them", choices=LOSS_TYPES),
    Flag("beta", float, 0.1, "weight of the k3 KL to the reference (the starting weights); 0 loads no reference"),
    Flag("epsilon", float, 0.2, "lower clip of the ratio: 1 - epsilon"),
    Flag("epsilon_high", float, None, "upper clip of the ratio: 1 + epsilon_high (cispo: the ratio's cap; default: "
         "5.0 for cispo, --epsilon otherwise)"),
    Flag("num_iterations", int, 1, "optimizer steps on each rollout (> 1: the ratio moves from 1 and clipping acts)"),
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
    for name in ("num_generations", "num_iterations"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    check_positive(args, "beta", zero=True)
    check_positive(args, "epsilon")
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else (
        CISPO_EPSILON_HIGH if args.loss_type == "cispo" else args.epsilon)
    if not (math.isfinite(epsilon_high) and epsilon_high > 0):
        raise ConfigError(f"--epsilon_high must be a positive number (got {epsilon_high})")
    return dict(num_generations=args.num_generations, beta=float(args.beta), loss_type=args.loss_type,
                epsilon=float(args.epsilon), epsilon_high=float(epsilon_high), num_iterations=args.num_iterations)


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
    """The GRPO loss for train_step (see trainer/core/objective.py); `prepare` makes the step's rollout."""

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        super().__init__(stage, plan, dims, engine, tokenizer, functions, weights, reference)
        self.items_are_tokens = stage.loss_type in TOKEN_LOSSES
        clip = ("cispo_clip_sum",) if stage.loss_type == "cispo" else ("clip_low_sum", "clip_high_sum",
                                                                       "clip_region_sum")
        self.row_stat_names = (*ROW_STATS, *(f"rewards/{n}" for n in self.reward_names))  # the row stats' columns
        self.stat_names = ("rows", "tokens", *self.row_stat_names, "entropy_sum", *clip,
                           *(("kl_sum",) if stage.beta else ()))

    # ------------------------------------------------------------------ the step's micro-batches
    def prepare(self, trainer, micro_batches):
        """Roll out this step's prompts (or reuse the last rollout within its num_iterations) into micro-batches
        (input_ids, labels, extra) of completion rows."""
        step = trainer.progress.global_step
        if self.buffer is None or step % self.stage.num_iterations == 0:
            self.buffer = self.roll_out(trainer, micro_batches, step)
        self.reused_next = (step + 1) % self.stage.num_iterations != 0  # the next step trains on this rollout too
        self.trained_positions = sum(ids.numel() for ids, _, _ in self.buffer)
        return self.buffer

    def roll_out(self, trainer, micro_batches, step):
        stage, plan = self.stage, self.plan
        rolled = self.roll_out_rows(trainer, micro_batches, step)
        rows = [row for row, _, _ in rolled]
        extras = [[advantages[:, None], row_stats] for _, advantages, row_stats in rolled]
        if stage.beta:
            for extra, values in zip(extras, scoring_log_probs(*self.reference, rows, plan, stage.temperature)):
                extra.append(values)
        if stage.num_iterations > 1:  # the generating policy's log-probs, for the ratio of the later iterations
            for extra, values in zip(extras, scoring_log_probs(trainer.model_parts, trainer.pipeline, rows, plan,
                                                               stage.temperature)):
                extra.append(values)
        return [(ids, labels, tuple(extra)) for (ids, labels), extra in zip(rows, extras)]

    def count(self, labels, extra):
        """This micro-batch's share of the step's normaliser: completion tokens (dapo, cispo), completions (grpo,
        dr_grpo) or one micro-batch (bnpo)."""
        loss_type = self.stage.loss_type
        return target_tokens(labels) if loss_type in TOKEN_LOSSES else 1 if loss_type == "bnpo" else labels.shape[0]

    # ------------------------------------------------------------------ the loss
    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        out = model(input_ids)
        main, stats = self.policy_loss(out.logits, targets, extra, num_items)
        return main, out.aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        return self.policy_loss(logits, targets, extra, num_items)

    def policy_loss(self, logits, targets, extra, num_items):
        """(this micro-batch's share of the step's loss, stats) from the policy's logits (N, L, V)."""
        stage = self.stage
        advantages, row_stats = extra[0], extra[1]
        mask = (targets != -100).float()
        log_probs = tempered_log_probs(logits, targets, stage.temperature)
        old = extra[-1] if stage.num_iterations > 1 else log_probs.detach()
        ratio = torch.exp((log_probs - old) * mask)
        if stage.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=stage.epsilon_high).detach() * advantages * log_probs
        else:
            clipped = torch.clamp(ratio, 1 - stage.epsilon, 1 + stage.epsilon_high)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
        if stage.beta:
            kl = k3_kl(extra[2], log_probs)
            per_token = per_token + stage.beta * kl
        loss = normalised(per_token * mask, mask, stage.loss_type, num_items, stage.max_gen_len)
        stats = dict(rows=torch.tensor(float(mask.shape[0])), tokens=mask.sum().detach(),
                     entropy_sum=(token_entropy(logits, stage.temperature) * mask).sum())
        stats.update(zip(self.row_stat_names, row_stats.sum(0)))
        stats.update(clip_stats(ratio.detach(), advantages, mask, stage))
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
        if self.stage.loss_type == "cispo":
            out["cispo_clip_ratio"] = stats["cispo_clip_sum"] / tokens
        else:
            for side in ("low", "high", "region"):
                out[f"clip_ratio/{side}_mean"] = stats[f"clip_{side}_sum"] / tokens
        return {**out, **self.rollout_record()}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The policy's training FLOPs and the reference's forward (a third) on the rows as trained: the loop counts
        every row at the full row length, this rank's rows (as for the others) are as long as their completions;
        lm_head on every position."""
        rows = self.plan.micro_batch_shape[0] * self.plan.data.num_microbatches
        row_length = self.trained_positions / max(1, rows)
        train = step_flops(config, row_length, positions * row_length / seq_len, target_tokens, False)
        return train * (1 + (1 / 3 if self.stage.beta else 0))
