"""The optimizer of a run (--optimizer), from one table (OPTIMIZERS: name -> the class's module and name, and its
keyword arguments from the plan): torch's own where torch has one (AdamW, SGD, Muon), the papers' LAMB and LARS
written in trainer/runtime/optimizers.py, which a run reads only when it picks one of them."""
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from model.errors import ConfigError
from trainer.base.schema import Flag, fill
from trainer.parallel.mesh import dimension_module
from trainer.parallel.state_dict import clean_fqn


@dataclass(frozen=True)
class Optimizer:
    """One --optimizer: the module and name of its class (imported when a run picks it; a registry entry, which
    tests/test_house.py checks exists on this floor or below) and its keyword arguments besides lr, from the
    OptimizerPlan and `fused` (torch's fused kernel: True, False, or None for unset)."""
    module: str
    name: str
    kwargs: Callable
    matrices_apart: bool = False  # param groups: the decoder blocks' matrices (muon=True) apart from the rest


OPTIMIZERS = {
    "adamw": Optimizer("torch.optim", "AdamW", lambda plan, fused: dict(
        betas=plan.betas, eps=plan.eps, weight_decay=plan.weight_decay, **({} if fused is None else {"fused": fused}))),
    "lamb": Optimizer("trainer.runtime.optimizers", "Lamb", lambda plan, fused: dict(
        betas=plan.betas, eps=plan.eps, weight_decay=plan.weight_decay)),
    "lars": Optimizer("trainer.runtime.optimizers", "Lars", lambda plan, fused: dict(
        momentum=plan.momentum, weight_decay=plan.weight_decay)),
    "sgd": Optimizer("torch.optim", "SGD", lambda plan, fused: dict(
        momentum=plan.momentum, weight_decay=plan.weight_decay)),
    "muon": Optimizer("trainer.runtime.optimizers", "MuonWithAdamW", lambda plan, fused: dict(
        momentum=plan.momentum, weight_decay=plan.weight_decay, betas=plan.betas, eps=plan.eps),
        matrices_apart=True),
}


@dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer and the gradient clip (trainer/runtime/optimizer_choice.py)."""
    name: str  # --optimizer
    weight_decay: float
    betas: tuple  # --beta1, --beta2
    eps: float
    momentum: float  # sgd, lars, muon
    grad_clip: float
    FLAGS = (
        Flag("weight_decay", float, 0.01, "decoupled weight decay (adamw, lamb, muon), L2 term of sgd and lars"),
        Flag("eps", float, 1e-8, "denominator epsilon of adamw and lamb"),
        Flag("momentum", float, None, "momentum of sgd, lars and muon (default: 0.9; muon 0.95)"),
        Flag("grad_clip", float, 1.0, "clip the global gradient norm to this value"),
        Flag("optimizer", str, "adamw", "adamw, sgd (torch.optim); muon (torch.optim.Muon on the decoder blocks' "
             "matrices, AdamW on the rest; needs a torch that has it, 2.9+, else one error line); lamb, lars (the "
             "papers' trust-ratio updates, written here: torch has none)", choices=tuple(OPTIMIZERS)),
        Flag("beta1", float, 0.9, "first-moment decay of adamw, lamb and muon's AdamW part"),
        Flag("beta2", float, 0.999, "second-moment decay of adamw, lamb and muon's AdamW part"),
    )

    def kwargs(self, fused):
        """(optimizer class, its keyword arguments besides lr): the OPTIMIZERS entry of --optimizer."""
        entry = OPTIMIZERS[self.name]
        return getattr(importlib.import_module(entry.module), entry.name), entry.kwargs(self, fused)


def resolve_optimizer(args, has_dtensor):
    """--optimizer and its hyper-parameters -> OptimizerPlan; ConfigError for values that cannot be meant."""
    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {args.optimizer})")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be in [0, 1) (got {getattr(args, name)})")
    if not args.eps > 0:
        raise ConfigError(f"--eps must be positive (got {args.eps})")
    momentum = args.momentum if args.momentum is not None else 0.95 if args.optimizer == "muon" else 0.9
    if not 0 <= momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1) (got {momentum})")
    if args.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or newer; this is torch "
                              f"{torch.__version__}); upgrade torch or pick another of {', '.join(OPTIMIZERS)}")
        if has_dtensor:
            raise ConfigError("--optimizer muon orthogonalises each whole matrix, which FSDP2 and tensor parallel "
                              "shard; use --zero_stage 0 or 1 (DDP, ZeRO-1) and no --tp, or another optimizer")
    return fill(OptimizerPlan, args, name=args.optimizer, betas=(args.beta1, args.beta2), momentum=momentum)


def build_optimizer(model_parts, plan, dims):
    """This rank's optimizer over the trainable parameters of `model_parts` (ZeRO-1 shards its state over dp_cp)."""
    named = [(clean_fqn(name), p) for part in model_parts for name, p in part.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if OPTIMIZERS[plan.optim.name].matrices_apart:  # Muon: the blocks' matrices, AdamW: embeddings, lm_head, norms
        hidden = [p for name, p in named if p.ndim == 2 and ".layers." in f".{name}"]
        rest = [p for p in params if all(p is not h for h in hidden)]
        params = [dict(params=hidden, muon=True), dict(params=rest, muon=False)]
    layout = plan.layout
    # torch's fused AdamW kernel, CUDA and CPU (CPU, bench model: 3-5x faster than the default per-tensor loop); not
    # for DTensor parameters
    fused = not layout.has_dtensor if plan.optim.name == "adamw" else None
    optimizer_class, kwargs = plan.optim.kwargs(fused)
    if layout.dp_mode == "zero1":  # ZeroRedundancyOptimizer: the state sharded over the dp_cp ranks
        return dimension_module("dp").data_parallel_optimizer(params, plan.lr.peak, 1, dims.group("dp_cp"),
                                                              optimizer_class=optimizer_class, **kwargs)
    return optimizer_class(params, lr=plan.lr.peak, **kwargs)
