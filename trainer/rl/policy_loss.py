"""The RL losses as a table: each GRPO-family variant (LOSSES) names its advantage estimator, its importance ratio, its
surrogate, its normaliser, its clip statistics and its defaults, so the stage looks a variant up instead of
branching on its name; the extras that ride with a micro-batch to the loss are named tuples (GroupExtras, PPOExtras).
Beside them the per-token pieces: the k3 KL to a reference, the entropy metric (GRPO, agent); GAE, the clipped value
loss and the sample variance of PPO's records.

Variants (TRL's names and normalisers; r the importance ratio, A the advantage, per completion token t of row i):
  grpo, bnpo, dr_grpo, dapo: -min(r_t A_i, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_i), r_t = pi(t) / pi_old(t)
  cispo:                     -sg(min(r_t, epsilon_high)) A_i log pi(t)
  gspo (TRL's importance_sampling_level="sequence"): grpo's loss with r_i = exp(mean_t log(pi(t) / pi_old(t)))
  rloo (TRL's RLOOTrainer):  grpo's loss with r_i = exp(sum_t log(pi(t) / pi_old(t))), A_i = r_i - the mean reward
                             of the group's other completions
Normalisers: grpo (and gspo, rloo) the mean over completions of each one's token mean; bnpo the mean over
micro-batches of each one's token mean; dr_grpo the sum over rows / (rows x max_gen_len); dapo and cispo the sum
over the step's completion tokens / their number. Clip statistics: the share of tokens (of completions, for a
sequence-level ratio) whose ratio was clipped on each side (cispo: capped), TRL's clip_ratio/* (cispo_clip_ratio).
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from trainer.core.log_probs import log_softmax
from trainer.plan.objective import target_tokens


# ----------------------------------------------------------------------------- the extras a micro-batch carries
class GroupExtras(NamedTuple):
    """What rides with a GRPO/agent micro-batch to its loss (on the last pipeline stage too): per-row tensors."""
    advantages: torch.Tensor  # (N, 1)
    row_stats: torch.Tensor  # (N, S): the rollout's per-row stats (rewards, lengths, ...)
    reference: Optional[torch.Tensor] = None  # (N, L) the reference's log-probs (beta > 0)
    old_log_probs: Optional[torch.Tensor] = None  # (N, L) the generating policy's log-probs (num_iterations > 1)

    @classmethod
    def of(cls, tensors, fields):
        """Back from the present tensors (what a pipeline schedule carries: no None) given their field names."""
        return tensors if isinstance(tensors, cls) else cls(**dict(zip(fields, tensors)))


class PPOExtras(NamedTuple):
    """What rides with a PPO micro-batch to its loss: per-token tensors (N, L) and the per-row stats."""
    advantages: torch.Tensor  # whitened GAE advantages
    returns: torch.Tensor
    old_values: torch.Tensor
    old_log_probs: torch.Tensor
    row_stats: torch.Tensor


# ----------------------------------------------------------------------------- advantages
def group_advantages(rewards, num_generations):
    """(advantages, group std per row): (r - group mean) / (group std + 1e-4), std over the group's G rewards
    (population std, MiniMind's: 0 for G = 1, where TRL's sample std would be undefined)."""
    groups = rewards.view(-1, num_generations)
    std = groups.std(dim=1, unbiased=False)
    advantages = (groups - groups.mean(dim=1, keepdim=True)) / (std[:, None] + 1e-4)
    return advantages.reshape(-1), std.repeat_interleave(num_generations)


def leave_one_out_advantages(rewards, num_generations):
    """(advantages, group std per row): r - the mean of the group's other rewards (RLOO; TRL's RLOOTrainer with
    normalize_advantages False); the std as group_advantages gives it, for the records."""
    groups = rewards.view(-1, num_generations)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / max(num_generations - 1, 1)
    std = groups.std(dim=1, unbiased=False)
    return (groups - baseline).reshape(-1), std.repeat_interleave(num_generations)


# ----------------------------------------------------------------------------- importance ratios
def token_ratio(log_probs, old, mask):
    """(N, L) pi(t) / pi_old(t) per completion token (1 off the mask)."""
    return torch.exp((log_probs - old) * mask)


def sequence_mean_ratio(log_probs, old, mask):
    """(N, 1) GSPO's exp(mean_t log(pi(t) / pi_old(t))) over each completion's tokens."""
    return torch.exp(((log_probs - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))


def sequence_sum_ratio(log_probs, old, mask):
    """(N, 1) RLOO's pi(y) / pi_old(y) = exp(sum_t log(pi(t) / pi_old(t))) of each whole completion."""
    return torch.exp(((log_probs - old) * mask).sum(1, keepdim=True))


# ----------------------------------------------------------------------------- surrogates
def clipped_surrogate(ratio, advantages, log_probs, epsilon, epsilon_high):
    """-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) (PPO's two-sided clip)."""
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo_surrogate(ratio, advantages, log_probs, epsilon, epsilon_high):
    """-sg(min(r, epsilon_high)) A log pi (CISPO: the capped ratio weighs the REINFORCE term)."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * advantages * log_probs


# ----------------------------------------------------------------------------- normalisers
@dataclass(frozen=True)
class Normaliser:
    """How a step's per-token losses become one number: `items` counts a micro-batch's share of the step's divisor
    (from its CPU labels), `reduce` sums a micro-batch's masked losses (N, L) over it."""
    items: Callable
    reduce: Callable


def per_sequence(loss, mask, num_items, max_gen_len):
    return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_items


def per_micro_batch(loss, mask, num_items, max_gen_len):
    return loss.sum() / mask.sum().clamp(min=1) / num_items


def per_max_length(loss, mask, num_items, max_gen_len):
    return loss.sum() / (num_items * max_gen_len)


def per_token(loss, mask, num_items, max_gen_len):
    return loss.sum() / num_items


SEQUENCE_MEAN = Normaliser(lambda labels: labels.shape[0], per_sequence)  # grpo: completions
MICRO_BATCH_MEAN = Normaliser(lambda labels: 1, per_micro_batch)  # bnpo: micro-batches
MAX_LENGTH = Normaliser(lambda labels: labels.shape[0], per_max_length)  # dr_grpo: completions x max_gen_len
TOKEN_MEAN = Normaliser(target_tokens, per_token)  # dapo, cispo: completion tokens


# ----------------------------------------------------------------------------- clip statistics
def two_sided_clips(ratio, advantages, epsilon, epsilon_high):
    """Clipped low (r < 1 - epsilon, A < 0), high (r > 1 + epsilon_high, A > 0) and either."""
    low, high = (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
    return low, high, low | high


def cispo_clips(ratio, advantages, epsilon, epsilon_high):
    """Capped: r > epsilon_high with A > 0."""
    return ((ratio > epsilon_high) & (advantages > 0),)


@dataclass(frozen=True)
class ClipStats:
    """The clip counts a variant logs: their stat names (summed over the step) and TRL's record names."""
    stats: tuple
    records: tuple
    flags: Callable  # (ratio, advantages, epsilon, epsilon_high) -> a bool tensor per stat

    def sums(self, ratio, advantages, weight, epsilon, epsilon_high):
        """{stat: count}, each flag weighted by `weight` (the token mask, or 1 per row for a sequence ratio)."""
        flags = self.flags(ratio, advantages, epsilon, epsilon_high)
        return {name: (flag.float() * weight).sum() for name, flag in zip(self.stats, flags)}


TWO_SIDED = ClipStats(("clip_low_sum", "clip_high_sum", "clip_region_sum"),
                      ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"), two_sided_clips)
CISPO_CAP = ClipStats(("cispo_clip_sum",), ("cispo_clip_ratio",), cispo_clips)


# ----------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class LossVariant:
    """One GRPO-family loss: its advantage estimator, importance ratio, surrogate, normaliser, clip statistics, and
    the defaults of --epsilon and --epsilon_high (None: --epsilon's)."""
    advantages: Callable
    ratio: Callable
    surrogate: Callable
    normaliser: Normaliser
    clips: ClipStats
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None

    @property
    def sequence_ratio(self):
        """One ratio per completion (GSPO, RLOO): the clip statistics count completions, not tokens."""
        return self.ratio is not token_ratio


def variant(surrogate, normaliser, clips=TWO_SIDED, advantages=group_advantages, ratio=token_ratio, **defaults):
    return LossVariant(advantages, ratio, surrogate, normaliser, clips, **defaults)


LOSSES = {
    "grpo": variant(clipped_surrogate, SEQUENCE_MEAN),
    "dapo": variant(clipped_surrogate, TOKEN_MEAN),
    "dr_grpo": variant(clipped_surrogate, MAX_LENGTH),
    "bnpo": variant(clipped_surrogate, MICRO_BATCH_MEAN),
    "cispo": variant(cispo_surrogate, TOKEN_MEAN, CISPO_CAP, epsilon_high=5.0),  # MiniMind's --epsilon_high for cispo
    "gspo": variant(clipped_surrogate, SEQUENCE_MEAN, ratio=sequence_mean_ratio, epsilon=3e-4, epsilon_high=4e-4),
    "rloo": variant(clipped_surrogate, SEQUENCE_MEAN, advantages=leave_one_out_advantages, ratio=sequence_sum_ratio),
}


def k3_kl(reference, log_probs):
    """Per-token k3 estimate of KL(policy || reference): exp(ref - log pi) - (ref - log pi) - 1 (>= 0, and 0 with a
    zero gradient where the two agree)."""
    delta = reference - log_probs
    return torch.exp(delta) - delta - 1


@torch.no_grad()
def token_entropy(logits, temperature, chunk=1024):
    """(N, L) entropy of softmax(logits / temperature) per position, in fp32 chunks of rows (a metric only)."""
    if hasattr(logits, "placements"):  # vocab-sharded under tensor parallel: DTensor reductions, then the full value
        log_p = log_softmax(logits.detach().float() / temperature)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return entropy.full_tensor() if hasattr(entropy, "full_tensor") else entropy
    flat = logits.detach().flatten(0, 1)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        log_p = torch.log_softmax(flat[start:start + chunk].float() / temperature, dim=-1)
        out[start:start + chunk] = -(log_p.exp() * log_p).sum(-1)
    return out.view(logits.shape[:2])


def gae(rewards, values, mask, gamma, lam):
    """(advantages, returns) (N, L) of per-token rewards and values on each row's masked positions (its completion
    tokens, contiguous): delta_t = r_t + gamma V_(t+1) - V_t and A_t = delta_t + gamma lam A_(t+1), V and A 0 after
    the last token; R_t = A_t + V_t. 0 off the mask."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else 0.0
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def value_loss(values, old_values, returns, cliprange_value):
    """(per-token loss 0.5 max((V - R)^2, (V_clipped - R)^2), where the clipped term is the larger), V_clipped =
    V_old + clip(V - V_old, -c, c) (TRL's clip_by_value)."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    plain, clipped = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.max(plain, clipped), clipped > plain


def last_token_positions(mask):
    """(N,) index of each row's last masked position."""
    return mask.cumsum(1).argmax(1)


def unbiased_var(total, squares, count):
    """The sample variance of `count` values from their sum and sum of squares (0 for fewer than 2)."""
    return max(squares - total * total / count, 0.0) / (count - 1) if count > 1 else 0.0
