"""The optimizers written here, read by the runs that pick them (trainer/runtime/optimizer_choice.py OPTIMIZERS): the
two trust-ratio optimizers of the large-batch papers, which torch lacks: LAMB (You et al. 2019, "Large Batch
Optimization for Deep Learning", Algorithm 2) and LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of
Convolutional Networks", Algorithm 1); and torch's Muon with AdamW behind one Optimizer.

Every optimizer runs under every layout: its state is keyed like its parameter (DTensor shards under FSDP2 and
tensor parallel, whole tensors under DDP, ZeRO-1 and pipeline stages), so DCP saves and reshards it. The trust
ratios need each parameter's norm over all its shards: the local sums of squares of a group of DTensors go through
one all-reduce (`global_norms`), in float64 like the gradient clip's, and never to the host.
"""
import inspect

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainer.base.launch import local_shard

LARS_TRUST = 0.001  # LARS's trust coefficient eta (the paper's value)


# ----------------------------------------------------------------------------------------------- norms
def global_norms(tensors, like):
    """The L2 norm of each of `tensors` (local shards, or plain tensors) over every rank holding a shard of it:
    `like[i]` is the parameter it is shaped like (a DTensor's shards are summed over its sharded mesh dimensions).
    float64 sums of squares, one all-reduce per (mesh, placements); plain 0-dim float64 tensors, no host read."""
    sums = [t.detach().square().sum(dtype=torch.float64) for t in tensors]
    groups = {}
    for i, param in enumerate(like):
        key = (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None
        groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        if key is None:
            continue
        mesh, placements = key
        partial = [Partial() if isinstance(p, Shard) else Replicate() for p in placements]
        stacked = DTensor.from_local(torch.stack([sums[i] for i in members]), mesh, partial, run_check=False)
        total = stacked.full_tensor()  # sums the shards' partial sums; replicated dimensions count once
        for j, i in enumerate(members):
            sums[i] = total[j]
    return [s.sqrt() for s in sums]


def trust_ratio(numerator, denominator):
    """numerator / denominator where both are positive, else 1 (a zero weight or update keeps the global lr)."""
    ratio = numerator / denominator.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where((numerator > 0) & (denominator > 0), ratio, torch.ones_like(ratio))


# ----------------------------------------------------------------------------------------------- LAMB, LARS
class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, Algorithm 2), per parameter tensor:
        m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,  r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
        u = r + weight_decay * w,  w <- w - lr * (||w|| / ||u||) * u      (the ratio is 1 if either norm is 0)
    State per parameter: step, exp_avg, exp_avg_sq (AdamW's names)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            weights, updates = [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                g, w = local_shard(p.grad), local_shard(p)
                m, v = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                step = state["step"].item()  # a CPU tensor, as AdamW's: no device sync (a CUDA copy would be one)
                m_hat = m / (1 - b1 ** step)
                v_hat = v / (1 - b2 ** step)
                updates.append(m_hat / (v_hat.sqrt() + eps) + wd * w)
                weights.append(w)
            norms = global_norms(weights + updates, params + params)
            for w, u, w_norm, u_norm in zip(weights, updates, norms[:len(params)], norms[len(params):]):
                w.sub_(u * (group["lr"] * trust_ratio(w_norm, u_norm)).to(u.dtype))
        return loss


class Lars(torch.optim.Optimizer):
    """LARS (You, Gitman, Ginsburg 2017, Algorithm 1), per parameter tensor, with trust coefficient eta:
        local_lr = eta * ||w|| / (||g|| + weight_decay * ||w||)       (1 if ||w|| or ||g|| is 0)
        v = momentum * v + lr * local_lr * (g + weight_decay * w),  w <- w - v
    State per parameter: momentum_buffer (SGD's name)."""

    def __init__(self, params, lr=1e-3, momentum=0.9, weight_decay=0.0, trust_coefficient=LARS_TRUST):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            wd, eta = group["weight_decay"], group["trust_coefficient"]
            weights, grads = [local_shard(p) for p in params], [local_shard(p.grad) for p in params]
            norms = global_norms(weights + grads, params + params)
            for p, w, g, w_norm, g_norm in zip(params, weights, grads, norms[:len(params)], norms[len(params):]):
                local_lr = trust_ratio(eta * w_norm, g_norm + wd * w_norm)  # 1 for a zero weight
                local_lr = torch.where(g_norm > 0, local_lr, torch.ones_like(local_lr))  # and for a zero gradient
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = local_shard(state["momentum_buffer"])
                buf.mul_(group["momentum"]).add_((g + wd * w) * (group["lr"] * local_lr).to(g.dtype))
                w.sub_(buf)
        return loss


# ----------------------------------------------------------------------------------------------- Muon
class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the param groups marked `muon` (the decoder blocks' matrices) and torch.optim.AdamW on the
    others (embeddings, lm_head, norms), as torch's Muon documentation prescribes, behind one Optimizer: one state
    and one list of param groups, which checkpoints (DCP) and ZeRO-1 see as any optimizer's. Muon's update is scaled
    by 0.2 * sqrt(max(rows, cols)) (torch's "match_rms_adamw"), so AdamW's --learning_rate carries over."""

    def __init__(self, params, lr=1e-3, momentum=0.95, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, muon=False))
        self.muon_defaults = dict(momentum=momentum, weight_decay=weight_decay)
        if "adjust_lr_fn" in inspect.signature(torch.optim.Muon).parameters:  # a Muon without it: Keller's scaling
            self.muon_defaults["adjust_lr_fn"] = "match_rms_adamw"
        self.adamw_defaults = dict(betas=betas, eps=eps, weight_decay=weight_decay)
        self._link()

    def _link(self):
        """Torch's two optimizers over this one's groups (the same dicts) and state (the same mapping)."""
        self.inner = []
        for muon, make, defaults in ((True, torch.optim.Muon, self.muon_defaults),
                                     (False, torch.optim.AdamW, self.adamw_defaults)):
            groups = [g for g in self.param_groups if g["muon"] == muon]
            if any(g["params"] for g in groups):
                optimizer = make(groups, lr=self.defaults["lr"], **defaults)
                optimizer.state = self.state
                self.inner.append(optimizer)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # new group dicts and state: link torch's optimizers to them again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for optimizer in self.inner:
            optimizer.step()
        return loss
