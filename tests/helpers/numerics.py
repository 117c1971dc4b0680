"""Tolerances derived from the math, for comparing an optimizer step across layouts.

AdamW's first step moves a weight by u(g) = lr * g / (|g| + eps) (bias-corrected m = g, sqrt(v) = |g|).
Its slope is lr * eps / (|g| + eps)^2: flat where |g| >> eps, steep (up to lr / eps) where |g| ~ eps. So two
runs whose gradients differ by reduction-order rounding can move a near-zero-gradient weight by visibly
different amounts, and how much depends on the CPU's kernels (AVX2 vs AVX-512) and the gloo reduction order.
A fixed atol either hides real errors on well-conditioned weights or fails on ill-conditioned ones; the bound
below is per element, from the two gradients actually measured, and is tight wherever the step is meaningful.
"""
import math

import torch

FP32_EPS = torch.finfo(torch.float32).eps
# A gradient computed in another reduction order (dp's half batches and all-reduce, tp's sharded matmuls, cp's ring
# blocks, pp's micro-batches): rounding of sums of a few hundred terms, bounded per tensor by 64 ulp of its largest
# element (the tiny test models' terms are no larger than the sums' scale).
GRAD_ULPS = 64


def grad_norm_bound(ref_norm, num_params):
    """Largest |norm - ref_norm| of one gradient (same weights, same batch) computed in another reduction order.

    Each element differs by at most GRAD_ULPS ulp of its tensor's largest element, itself at most the norm, so
    |norm - ref_norm| <= |g - r| <= GRAD_ULPS * eps * sqrt(num_params) * norm; plus each norm's own fp32 rounding (a
    sum of num_params squares: about log2(num_params) ulp when summed in blocks, across ranks too; the sqrt: 1)."""
    return ref_norm * FP32_EPS * (GRAD_ULPS * math.sqrt(num_params) + 2 * (math.log2(num_params) + 1))


def adam_first_step_bound(grad, ref_grad, ref_weight, lr, eps):
    """Largest |w - w_ref| after one AdamW step from equal weights, given the two gradients.

    Mean value theorem on u(g): |u(g) - u(r)| <= lr * eps * |g - r| / (m + eps)^2, m = min |x| for x between
    g and r (0 when they differ in sign), capped at 2 * lr. Plus fp32 rounding of both updates (a few ulp of
    lr: exp_avg, exp_avg_sq, sqrt, division) and of both weights (decay multiply and update add: ulp of |w|).
    """
    grad, ref_grad = grad.double(), ref_grad.double()
    same_sign = grad * ref_grad >= 0
    nearest_to_zero = torch.where(same_sign, torch.minimum(grad.abs(), ref_grad.abs()), torch.zeros_like(grad))
    propagated = lr * eps * (grad - ref_grad).abs() / (nearest_to_zero + eps) ** 2
    rounding = FP32_EPS * (8 * lr + 4 * ref_weight.double().abs())
    return torch.clamp(propagated, max=2 * lr) + rounding


def assert_adam_first_step_close(weight, ref_weight, grad, ref_grad, lr, eps, what):
    """Compare weights after one AdamW step element by element against adam_first_step_bound."""
    bound = adam_first_step_bound(grad, ref_grad, ref_weight, lr, eps)
    excess = (weight.double() - ref_weight.double()).abs() - bound
    worst = int(excess.argmax())
    differs = float(excess.flatten()[worst] + bound.flatten()[worst])
    assert excess.max() <= 0, (f"{what}: element {worst} differs by {differs:.3g}"
                               f" > bound {float(bound.flatten()[worst]):.3g} (grads {float(grad.flatten()[worst]):.3g}"
                               f" vs {float(ref_grad.flatten()[worst]):.3g})")
    return bound


def adamw_f64_step(weight, grad, state, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """torch.optim.AdamW's step in float64 from `weight` (one tensor) -> (new weight, fp32 rounding bound).

    state: {} on the first step, then carried (step, exp_avg, exp_avg_sq, and abs_avg, the same average of |g|).
    This is well-conditioned where comparing two runs is not: the fp32 optimizer and this one see the same
    gradient, so they differ only by fp32 rounding, relative to what each operand holds. exp_avg's rounding is
    relative to abs_avg (its terms may cancel), a couple of ulp per step; exp_avg_sq's (no cancellation) and
    the division's are relative to the update; the decay multiply and the add are relative to |w|.
    """
    beta1, beta2 = betas
    grad = grad.double()
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(grad), exp_avg_sq=torch.zeros_like(grad),
                     abs_avg=torch.zeros_like(grad))
    state["step"] += 1
    step = state["step"]
    state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * grad
    state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad
    state["abs_avg"] = beta1 * state["abs_avg"] + (1 - beta1) * grad.abs()
    step_size = lr / (1 - beta1 ** step)
    denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step) + eps
    update = step_size * state["exp_avg"] / denom
    weight = weight.double()
    new_weight = weight * (1 - lr * weight_decay) - update
    bound = FP32_EPS * ((2 * step + 4) * step_size * state["abs_avg"] / denom + (step + 4) * update.abs()
                        + 3 * weight.abs())
    return new_weight, bound
