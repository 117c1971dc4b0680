"""PPO (Schulman et al. 2017; MiniMind's train_ppo.py, TRL's PPOTrainer): the stage plan, the value head, GAE and
the objective.

The critic is a value head on the policy's own trunk: V(s_t) = w . h_t + b on the final norm's output h_t, a small
module hung on that norm from outside the model (a child module and a forward hook). So it goes wherever the norm
goes: the last pipeline stage, replicated under tensor parallel, with the root's parameters under FSDP2; its
parameters are trained by the one optimizer and saved in resume checkpoints with the actor's (the weights file holds
the actor only). Each rollout, `prepare`:
  1. completes each prompt once (trainer/rl/rollout.py) and scores it (trainer/rl/rewards.py, as GRPO);
  2. runs one no-grad forward of the policy for its log-probs pi_old (at the sampling temperature) and values V_old,
     and one of the frozen reference (the starting weights) for its log-probs, when kl_coef > 0;
  3. per-token rewards r_t = -kl_coef (log pi_old(t) - log ref(t)), plus the score at the completion's last token
     (TRL's, the KL penalty in the reward);
  4. GAE over each completion: delta_t = r_t + gamma V_old(t+1) - V_old(t), A_t = delta_t + gamma lambda A_(t+1)
     (both 0 after the last token), returns R_t = A_t + V_old(t); the advantages whitened over the step's completion
     tokens on every data-parallel rank (population variance, MiniMind's).
The rollout is trained on --ppo_update_iters optimizer steps in a row (each over all its rows); before each further
one, a no-grad forward checks the policy's approx KL to pi_old and rolls out anew past --early_stop_kl. The loss of
each completion token, with ratio r = pi / pi_old, mean over the step's completion tokens:
  max(-A r, -A clip(r, 1 - clip_epsilon, 1 + clip_epsilon)) + vf_coef 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2)
with c = cliprange_value. On the first step on a rollout pi_old is the current policy, detached: the ratio is exactly 1.
"""
import math
from dataclasses import dataclass

import torch

from model.errors import ConfigError
from model.weights.shapes import clean_state_dict
from trainer.base.launch import world_sum
from trainer.base.schema import Flag
from trainer.core.batches import step_targets
from trainer.core.trunk_head import TrunkHead, fill_uniform
from trainer.observe.metrics import step_flops
from trainer.rl.base import (
    RolloutObjective,
    RolloutPlan,
    check_positions,
    engine_line,
    resolve_rollout,
    rewards_line,
)
from trainer.rl.policy_loss import PPOExtras, gae, last_token_positions, token_entropy, unbiased_var, value_loss
from trainer.rl.rows import scoring_forward, scoring_log_probs, tempered_log_probs

# per-row stats of a rollout, summed over the step's rows in the loss's stats
ROW_STATS = ("score_sum", "score_sq_sum", "length_sum", "truncated_sum", "kl_sum", "non_score_sum", "neg_logp_sum",
             "returns_sum", "returns_sq_sum", "values_sum", "values_sq_sum")
TOKEN_STATS = ("pg_sum", "vf_sum", "clipfrac_sum", "approxkl_sum", "policykl_sum", "entropy_sum", "vpred_sum",
               "verror_sum", "vclipfrac_sum", "advantages_sum")


@dataclass(frozen=True)
class PPOPlan(RolloutPlan):
    """PPO's checked flags: the shared rollout ones, the losses', GAE's and the update schedule's."""
    clip_epsilon: float
    cliprange_value: float
    vf_coef: float
    kl_coef: float
    gamma: float
    lam: float
    ppo_update_iters: int
    early_stop_kl: float
    seed: int  # the value head's init
    name = "PPO"
    FLAGS = RolloutPlan.FLAGS + (  # MiniMind's defaults and names
        Flag("clip_epsilon", float, 0.2, "the policy ratio's clip range: [1 - clip, 1 + clip]"),
        Flag("cliprange_value", float, 0.2, "the value prediction's clip range around the rollout's"),
        Flag("vf_coef", float, 0.5, "weight of the value loss beside the policy loss"),
        Flag("kl_coef", float, 0.02, "per-token KL penalty to the reference in the reward (the starting weights); 0 "
             "loads no reference"),
        Flag("gamma", float, 1.0, "GAE's discount"),
        Flag("lam", float, 0.95, "GAE's lambda"),
        Flag("ppo_update_iters", int, 2, "optimizer steps on each rollout (each over the step's whole rollout: "
             "MiniMind's mini_batch_size = batch_size)", min=1),
        Flag("early_stop_kl", float, 0.25, "roll out anew once the policy's approx KL to the rollout's exceeds this "
             "(checked before each further update on a rollout; 0: off)"),
    )

    @classmethod
    def resolve(cls, args, plan):
        return resolve_ppo(args, plan)

    @property
    def uses_reference(self):
        return self.kl_coef > 0

    def rollout_objective(self, *parts):
        return PPOObjective(self, *parts)

    def start_line(self, plan, objective):
        return describe(plan, objective)

    @property
    def num_generations(self):
        return 1  # one completion per prompt: the value head is the baseline

    def prepare_model(self, model):
        """Hang a fresh value head on the plain model's trunk (before parallelizing; a resume loads its weights)."""
        ValueHead(model.config.hidden_size, self.seed).attach(model)
        return model

    def weights_state(self, model_state):
        """The actor: the weights file holds no value head (MiniMind's plain weights)."""
        return clean_state_dict(model_state)


def resolve_ppo(args, plan):
    """Check PPO's flags against the TrainPlan; ConfigError (one line) on bad input."""
    for name in ("clip_epsilon", "cliprange_value"):  # plain checks, as trainer/plan/checks.py check_numbers
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ConfigError(f"--{name} must be a positive number (got {getattr(args, name)})")
    for name in ("vf_coef", "kl_coef", "early_stop_kl"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise ConfigError(f"--{name} must be a non-negative number (got {getattr(args, name)})")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"--{name} must lie in [0, 1] (got {getattr(args, name)})")
    stage = PPOPlan(**resolve_rollout(args, plan, "PPO"), clip_epsilon=float(args.clip_epsilon),
                    cliprange_value=float(args.cliprange_value), vf_coef=float(args.vf_coef),
                    kl_coef=float(args.kl_coef), gamma=float(args.gamma), lam=float(args.lam),
                    ppo_update_iters=args.ppo_update_iters, early_stop_kl=float(args.early_stop_kl),
                    seed=plan.data.seed)
    check_positions(stage.row_length, plan, "--max_seq_len + --max_gen_len")
    return stage


def describe(plan, objective):
    """The run's line at start."""
    stage = plan.stage
    line = (f"PPO from --from_weight {plan.model.from_weight}: one completion per prompt (up to {stage.max_gen_len} "
            f"tokens, temperature {stage.temperature}, top_p {stage.top_p}, {engine_line(stage)}); value head on the "
            f"trunk (vf_coef {stage.vf_coef}, cliprange_value {stage.cliprange_value}), GAE gamma {stage.gamma} lambda "
            f"{stage.lam}, clip_epsilon {stage.clip_epsilon}, kl_coef {stage.kl_coef}"
            f"{' (reference: the starting weights)' if stage.kl_coef else ''}; rewards: {rewards_line(objective)}")
    if stage.ppo_update_iters > 1:
        line += (f"; each rollout trains up to {stage.ppo_update_iters} steps (fewer past approx KL "
                 f"{stage.early_stop_kl}): the prompt batches drawn in the steps between are not generated from")
    return line


class ValueHead(TrunkHead):
    """The critic: one linear unit on the final norm's output, attached from outside (see the module docstring).
    nn.Linear's initialisation, drawn from its own generator (the global RNG stays the policy's)."""
    ATTRIBUTE = "value_head"  # model/weights/shapes.VALUE_HEAD: left out of the LM's weights

    def __init__(self, hidden_size, seed):
        super().__init__(hidden_size, bias=True)
        fill_uniform(self, seed)


class PPOObjective(RolloutObjective):
    """The PPO loss for train_step (see trainer/plan/objective.py); `prepare` rolls out, scores and runs GAE."""

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        super().__init__(stage, plan, dims, engine, tokenizer, functions, weights, reference)
        self.value_head = None  # found on the model once it is built (PPOPlan.prepare_model hangs it there)
        self.stat_names = ("rows", "tokens", *TOKEN_STATS, *ROW_STATS, *(f"rewards/{n}" for n in self.reward_names))
        self.updates = 0  # optimizer steps on the current rollout so far
        self.early_stops = self.scoring_forwards = 0

    # ------------------------------------------------------------------ the step's micro-batches
    def prepare(self, trainer, micro_batches):
        """Roll out this step's prompts, or train on the last rollout again (up to ppo_update_iters steps, while its
        approx KL stays within early_stop_kl), as micro-batches (input_ids, labels, extra) of completion rows."""
        step, self.scoring_forwards = trainer.progress.global_step, 0
        self.value_head = self.value_head or next(
            (m for part in trainer.model_parts for m in part.modules() if isinstance(m, ValueHead)), None)
        if self.buffer is None or self.updates >= self.stage.ppo_update_iters or self.drifted(trainer):
            self.buffer, self.updates = self.roll_out(trainer, micro_batches, step), 0
        self.updates += 1
        self.reused_next = self.updates < self.stage.ppo_update_iters
        self.trained_positions = sum(ids.numel() for ids, _, _ in self.buffer)
        return self.buffer

    def drifted(self, trainer):
        """The current policy's approx KL to the rollout's, 0.5 mean (log pi - log pi_old)^2 over the step's
        completion tokens on every dp rank, exceeds early_stop_kl (then the rollout is not trained on again)."""
        if not self.stage.early_stop_kl:
            return False
        rows = [(ids, labels) for ids, labels, _ in self.buffer]
        current = scoring_log_probs(trainer.model_parts, trainer.pipeline, rows, self.plan, self.stage.temperature)
        self.scoring_forwards += 1
        kl = tokens = 0.0
        for log_probs, (_, labels, extra) in zip(current, self.buffer):
            mask = (step_targets(labels) != -100).float()
            old = PPOExtras(*extra).old_log_probs
            kl, tokens = kl + float(0.5 * ((log_probs - old) ** 2 * mask).sum()), tokens + float(mask.sum())
        kl, tokens = world_sum([kl, tokens] if self.dims.counts_items else [0.0, 0.0], self.plan.layout.device)
        stop = kl / max(tokens, 1.0) > self.stage.early_stop_kl
        self.early_stops += stop
        return stop

    def roll_out(self, trainer, micro_batches, step):
        stage, plan = self.stage, self.plan
        rolled = self.roll_out_rows(trainer, micro_batches, step)
        rows = [row for row, _, _ in rolled]
        old = scoring_forward(trainer.model_parts, trainer.pipeline, rows, plan, self.log_probs_and_values, columns=2)
        reference = (scoring_log_probs(*self.reference, rows, plan, stage.temperature) if stage.kl_coef else
                     [None] * len(rows))
        self.scoring_forwards += 1 + bool(stage.kl_coef)
        parts = [self.advantages(labels, both, ref, row_stats)
                 for (_, labels), (_, _, row_stats), both, ref in zip(rows, rolled, old, reference)]
        mean, inv_std = self.whitening([(adv, mask) for adv, mask, *_ in parts])
        return [(ids, labels, PPOExtras((adv - mean) * inv_std * mask, returns, values, log_probs, stats))
                for (ids, labels), (adv, mask, returns, values, log_probs, stats) in zip(rows, parts)]

    def log_probs_and_values(self, logits, targets):
        """(N, L, 2): the policy's target log-probs at the sampling temperature and the value head's values."""
        return torch.stack([tempered_log_probs(logits, targets, self.stage.temperature), self.value_head.take()], -1)

    def advantages(self, labels, old, reference, row_stats):
        """GAE of one micro-batch: (raw advantages, mask, returns, old values, old log-probs, per-row stats)."""
        stage = self.stage
        mask = (step_targets(labels) != -100).float()
        log_probs, values = old[..., 0] * mask, old[..., 1] * mask
        kl = (log_probs - reference) * mask if reference is not None else torch.zeros_like(mask)
        rewards = -stage.kl_coef * kl
        score = row_stats[:, 0]
        rewards[torch.arange(len(mask)), last_token_positions(mask)] += score
        advantages, returns = gae(rewards, values, mask, stage.gamma, stage.lam)
        stats = torch.stack([score, score ** 2, row_stats[:, 3], row_stats[:, 4], kl.sum(1),
                             -stage.kl_coef * kl.sum(1), -log_probs.sum(1), returns.sum(1), (returns ** 2).sum(1),
                             values.sum(1), (values ** 2 * mask).sum(1)], dim=1)
        return advantages, mask, returns, values, log_probs, torch.cat([stats, row_stats[:, 5:]], dim=1)

    def whitening(self, parts):
        """(mean, 1 / sqrt(var + 1e-8)) of the advantages over the step's completion tokens on every dp rank."""
        total = sum(float((adv * mask).sum()) for adv, mask in parts)
        squares = sum(float((adv ** 2 * mask).sum()) for adv, mask in parts)
        count = sum(float(mask.sum()) for _, mask in parts)
        total, squares, count = world_sum([total, squares, count] if self.dims.counts_items else [0.0] * 3,
                                          self.plan.layout.device)
        mean = total / max(count, 1.0)
        return mean, 1 / math.sqrt(max(squares / max(count, 1.0) - mean ** 2, 0.0) + 1e-8)

    # ------------------------------------------------------------------ the loss
    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        out = model(input_ids)
        main, stats = self.ppo_loss(out.logits, self.value_head.take(), targets, extra, num_items)
        return main, out.aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        return self.ppo_loss(logits, self.value_head.take(), targets, extra, num_items)

    def ppo_loss(self, logits, values, targets, extra, num_items):
        """(this micro-batch's share of the step's loss, stats) from the policy's logits (N, L, V) and values (N, L)."""
        stage = self.stage
        advantages, returns, old_values, old_log_probs, row_stats = PPOExtras(*extra)  # a pipeline's plain tuple too
        mask = (targets != -100).float()
        log_probs = tempered_log_probs(logits, targets, stage.temperature)
        old = log_probs.detach() if self.updates == 1 else old_log_probs  # a fresh rollout: ratio exactly 1
        log_ratio = (log_probs - old) * mask
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1 - stage.clip_epsilon, 1 + stage.clip_epsilon)
        policy = torch.max(unclipped, clipped)
        value, value_clipped = value_loss(values, old_values, returns, stage.cliprange_value)
        loss = ((policy + stage.vf_coef * value) * mask).sum() / num_items
        log_ratio = log_ratio.detach()
        stats = dict(rows=torch.tensor(float(mask.shape[0])), tokens=mask.sum(),
                     pg_sum=(policy.detach() * mask).sum(), vf_sum=(value.detach() * mask).sum(),
                     clipfrac_sum=((clipped > unclipped).float() * mask).sum(),
                     approxkl_sum=0.5 * (log_ratio ** 2).sum(), policykl_sum=-log_ratio.sum(),
                     entropy_sum=(token_entropy(logits, stage.temperature) * mask).sum(),
                     vpred_sum=(values.detach() * mask).sum(),
                     verror_sum=((values.detach() - returns) ** 2 * mask).sum(),
                     vclipfrac_sum=(value_clipped.float() * mask).sum(), advantages_sum=(advantages * mask).sum())
        stats.update(zip(ROW_STATS + tuple(f"rewards/{n}" for n in self.reward_names), row_stats.sum(0)))
        return loss, stats

    # ------------------------------------------------------------------ records
    def record(self, stats, num_items):
        """TRL's PPO metric names (ppo/*, objective/*), the rewards', and the rollout's speed."""
        rows, tokens = max(stats["rows"], 1.0), max(stats["tokens"], 1.0)
        mean = {name: stats[f"{name}_sum"] / tokens for name in ("pg", "vf", "clipfrac", "approxkl", "policykl",
                                                                   "entropy", "vpred", "verror", "vclipfrac",
                                                                   "advantages", "returns", "values")}
        returns_var = unbiased_var(stats["returns_sum"], stats["returns_sq_sum"], tokens)
        out = {"objective/kl": stats["kl_sum"] / rows, "objective/entropy": stats["neg_logp_sum"] / rows,
               "objective/kl_coef": self.stage.kl_coef, "ppo/mean_non_score_reward": stats["non_score_sum"] / tokens,
               "ppo/mean_scores": stats["score_sum"] / rows,
               "ppo/std_scores": math.sqrt(unbiased_var(stats["score_sum"], stats["score_sq_sum"], rows)),
               **{f"rewards/{n}/mean": stats[f"rewards/{n}"] / rows for n in self.reward_names},
               "tokens/responses_len_mean": stats["length_sum"] / rows,
               "completions/clipped_ratio": stats["truncated_sum"] / rows,
               "ppo/loss/policy": mean["pg"], "ppo/loss/value": mean["vf"],
               "ppo/loss/total": mean["pg"] + self.stage.vf_coef * mean["vf"],
               "ppo/policy/entropy": mean["entropy"], "ppo/policy/approxkl": mean["approxkl"],
               "ppo/policy/policykl": mean["policykl"], "ppo/policy/clipfrac": mean["clipfrac"],
               "ppo/policy/advantages_mean": mean["advantages"], "ppo/returns/mean": mean["returns"],
               "ppo/returns/var": returns_var, "ppo/val/vpred": mean["vpred"], "ppo/val/error": mean["verror"],
               "ppo/val/clipfrac": mean["vclipfrac"], "ppo/val/mean": mean["values"],
               "ppo/val/var": unbiased_var(stats["values_sum"], stats["values_sq_sum"], tokens),
               "ppo/val/var_explained": 1 - mean["verror"] / returns_var if returns_var > 0 else 0.0,
               "ppo/early_stops": self.early_stops}
        self.early_stops = 0
        return {**out, **self.rollout_record()}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The policy's training FLOPs on the rows as trained, plus this step's no-grad forwards (a third each: the
        rollout's policy and reference forwards, the early-stop check)."""
        rows = self.plan.micro_batch_shape[0] * self.plan.data.num_microbatches
        row_length = self.trained_positions / max(1, rows)
        train = step_flops(config, row_length, positions * row_length / seq_len, target_tokens, False)
        return train * (1 + self.scoring_forwards / 3)

    # ------------------------------------------------------------------ resume
    def state_dict(self):
        """The rollout and its update count where the next step may train on it again; {} where it rolls out anew."""
        return {"buffer": self.buffer, "updates": self.updates} if self.reused_next else {}

    def load_state_dict(self, state):
        self.buffer, self.updates = state.get("buffer"), state.get("updates", 0)
