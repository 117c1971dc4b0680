"""The DPO family by `--loss_type` (TRL's names): one table of variants, each its per-pair loss, whether it needs the
reference model, whether it reads per-token (length-normalised) log-probs, and its default beta.

Every function takes the pair's policy log-probs pc, pr (B,), the reference's rc, rr (B,; zeros for a reference-free
loss) and the LossParams, and returns (per-pair losses (B,), {stat: per-pair values} of its own). With
l = (pc - rc) - (pr - rr):
  sigmoid  -logsig(b l)(1 - e) - logsig(-b l) e              (DPO; e > 0: conservative DPO, TRL's label smoothing)
  robust   (-logsig(b l)(1 - e) + logsig(-b l) e) / (1 - 2e)  (robust DPO, Chowdhury et al. 2024)
  hinge    relu(1 - b l)                                      (SLiC)
  ipo      (l - 1 / (2b))^2, on per-token log-probs           (IPO, Azar et al. 2023)
  simpo    sigmoid's on (pc - pr) - gamma / b, per-token, no reference         (SimPO, Meng et al. 2024)
  orpo     -pc - b logsig(log odds(pc) - log odds(pr)), per-token, no reference (ORPO, Hong et al. 2024; -pc: SFT's NLL)
where log odds(p) = p - log(1 - exp(p)).
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossParams:
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


@dataclass(frozen=True)
class LossType:
    fn: Callable  # (pc, pr, rc, rr, params) -> (losses (B,), {stat name: (B,) values})
    needs_reference: bool  # False: no reference model, no reference pass, no cache
    per_token: bool  # log-probs averaged over the row's target tokens (TRL's ipo, CPO's simpo, ORPO)
    beta: float  # the default --beta (TRL's, MiniMind's for sigmoid)
    smoothing: bool = False  # reads --label_smoothing
    stats: tuple = ()  # the names of fn's own stats


def smoothed_sigmoid(logits, beta, smoothing):
    return -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing


def sigmoid_loss(pc, pr, rc, rr, params):
    return smoothed_sigmoid((pc - rc) - (pr - rr), params.beta, params.label_smoothing), {}


def robust_loss(pc, pr, rc, rr, params):
    logits, e = (pc - rc) - (pr - rr), params.label_smoothing
    losses = (-F.logsigmoid(params.beta * logits) * (1 - e) + F.logsigmoid(-params.beta * logits) * e) / (1 - 2 * e)
    return losses, {}


def hinge_loss(pc, pr, rc, rr, params):
    return torch.relu(1 - params.beta * ((pc - rc) - (pr - rr))), {}


def ipo_loss(pc, pr, rc, rr, params):
    return ((pc - rc) - (pr - rr) - 1 / (2 * params.beta)) ** 2, {}


def simpo_loss(pc, pr, rc, rr, params):
    return smoothed_sigmoid(pc - pr - params.simpo_gamma / params.beta, params.beta, params.label_smoothing), {}


def log_odds(p):
    """log(p / (1 - p)) of a probability given as its log (< 0); a row at log-prob 0 (no target) stays finite."""
    p = p.clamp(max=-1e-6)
    return p - torch.log(-torch.expm1(p))


def orpo_loss(pc, pr, rc, rr, params):
    ratio = F.logsigmoid(log_odds(pc) - log_odds(pr))
    return -pc - params.beta * ratio, {"nll_loss": -pc.detach(), "log_odds_ratio": ratio.detach()}


LOSSES = {
    "sigmoid": LossType(sigmoid_loss, True, False, 0.15, smoothing=True),
    "robust": LossType(robust_loss, True, False, 0.1, smoothing=True),
    "hinge": LossType(hinge_loss, True, False, 0.1),
    "ipo": LossType(ipo_loss, True, True, 0.1),
    "simpo": LossType(simpo_loss, False, True, 2.0, smoothing=True),
    "orpo": LossType(orpo_loss, False, True, 0.1, stats=("nll_loss", "log_odds_ratio")),
}


def pair_losses(loss_type, params, log_probs, lengths, reference):
    """Per-pair losses of one micro-batch and their stats.

    log_probs: the policy's summed log-probs (2B,), pairs interleaved, chosen first; lengths: each row's target
    tokens (2B,); reference: the reference's summed log-probs (B, 2), or None for a reference-free loss.
    Returns (loss sum, stats: sums over the pairs of TRL's rewards/* and the loss's own, detached)."""
    policy = log_probs.float().view(-1, 2)
    ref = torch.zeros_like(policy) if reference is None else reference.float().view(-1, 2)
    if loss_type.per_token:  # a row without target tokens keeps its 0
        count = lengths.view(-1, 2).clamp(min=1).to(policy.device, policy.dtype)
        policy, ref = policy / count, ref / count
    losses, own = loss_type.fn(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], params)
    rewards = params.beta * (policy - ref).detach()  # TRL's rewards/chosen, rewards/rejected
    margins = rewards[:, 0] - rewards[:, 1]
    stats = {"chosen_reward_sum": rewards[:, 0].sum(), "rejected_reward_sum": rewards[:, 1].sum(),
             "accuracy_sum": (margins > 0).float().sum(), "margin_sum": margins.sum()}
    stats.update({f"{name}_sum": value.sum() for name, value in own.items()})
    return losses.sum(), stats
