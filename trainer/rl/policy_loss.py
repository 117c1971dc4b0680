"""Per-token pieces of the RL losses: TRL's normalisers, the clip-ratio counts, the k3 KL to a reference and the
entropy metric (GRPO, agent); GAE, the clipped value loss and the sample variance of PPO's records."""
import torch

from trainer.stages.distillation import log_softmax


def k3_kl(reference, log_probs):
    """Per-token k3 estimate of KL(policy || reference): exp(ref - log pi) - (ref - log pi) - 1 (>= 0, and 0 with a
    zero gradient where the two agree)."""
    delta = reference - log_probs
    return torch.exp(delta) - delta - 1


def normalised(loss, mask, loss_type, num_items, max_gen_len):
    """Sum of the masked per-token losses (N, L) under `loss_type`'s normaliser, num_items its step count."""
    if loss_type == "grpo":
        return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_items
    if loss_type == "bnpo":
        return loss.sum() / mask.sum().clamp(min=1) / num_items
    if loss_type == "dr_grpo":
        return loss.sum() / (num_items * max_gen_len)
    return loss.sum() / num_items


def clip_stats(ratio, advantages, mask, stage):
    """Token counts of TRL's clip ratios: cispo's ratio above epsilon_high with A > 0; else low (r < 1 - epsilon,
    A < 0), high (r > 1 + epsilon_high, A > 0) and either."""
    if stage.loss_type == "cispo":
        return {"cispo_clip_sum": (((ratio > stage.epsilon_high) & (advantages > 0)).float() * mask).sum()}
    low = ((ratio < 1 - stage.epsilon) & (advantages < 0)).float() * mask
    high = ((ratio > 1 + stage.epsilon_high) & (advantages > 0)).float() * mask
    return {"clip_low_sum": low.sum(), "clip_high_sum": high.sum(), "clip_region_sum": (low + high).sum()}


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
