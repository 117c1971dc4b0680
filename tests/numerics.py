"""Tolerances derived from the math, for comparing an optimizer step across layouts.

AdamW's first step moves a weight by u(g) = lr * g / (|g| + eps) (bias-corrected m = g, sqrt(v) = |g|).
Its slope is lr * eps / (|g| + eps)^2: flat where |g| >> eps, steep (up to lr / eps) where |g| ~ eps. So two
runs whose gradients differ by reduction-order rounding can move a near-zero-gradient weight by visibly
different amounts, and how much depends on the CPU's kernels (AVX2 vs AVX-512) and the gloo reduction order.
A fixed atol either hides real errors on well-conditioned weights or fails on ill-conditioned ones; the bound
below is per element, from the two gradients actually measured, and is tight wherever the step is meaningful.
"""
import torch

FP32_EPS = torch.finfo(torch.float32).eps


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
    assert excess.max() <= 0, (f"{what}: element {worst} differs by {float(excess.flatten()[worst] + bound.flatten()[worst]):.3g}"
                               f" > bound {float(bound.flatten()[worst]):.3g} (grads {float(grad.flatten()[worst]):.3g}"
                               f" vs {float(ref_grad.flatten()[worst]):.3g})")
    return bound
