"""Speed and memory transforms applied to a plain (or tp/cp-wrapped) model, keeping parameter names unchanged.

- `apply_activation_checkpointing(model, mode)`: each decoder block ("full"), or only its attention or its MLP
  sub-layer (selective), recomputes its activations in backward (torch.utils.checkpoint, non-reentrant). The
  module's `forward` is patched in place instead of wrapping it (torch's checkpoint_wrapper would add
  `_checkpoint_wrapped_module.` to every FQN, and our checkpoints are keyed by FQN).
- `compile_blocks(model)`: torch.compile each decoder block in place (`nn.Module.compile`, same FQNs). On CPU,
  inductor's C++ kernels fuse the casts autocast inserts and the elementwise work around the matmuls, two thirds
  of an eager bf16 step (docs/benchmarks.md section 12).

Both run inside parallelize.parallelize, after the sharding dimensions and before data parallel (its docstring
states the order).
"""
import types

import torch
from torch.utils.checkpoint import checkpoint


def decoder_blocks(model):
    """The decoder blocks of a MiniMindForCausalLM, a MiniMindModel or a pipeline stage module."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (expected .model.layers or .layers)")
    return [block for block in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)
            if block is not None]


def _checkpointed_forward(self, *args, **kwargs):
    """The block's class forward under non-reentrant checkpointing (plain call when no grad is needed)."""
    forward = type(self).forward
    if not torch.is_grad_enabled():  # eval / generation: nothing to save, nothing to recompute
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


CHECKPOINT_MODES = ("full", "attention", "mlp")


def apply_activation_checkpointing(model, mode="full"):
    """Recompute in backward every decoder block (full), or each block's self_attn or mlp only; returns the model.
    Parameter FQNs do not change."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {CHECKPOINT_MODES} (got {mode!r})")
    for block in decoder_blocks(model):
        module = {"full": block, "attention": block.self_attn, "mlp": block.mlp}[mode]
        # a bound method in the instance dict: deepcopy rebinds it to the copy, state_dict never sees it
        module.forward = types.MethodType(_checkpointed_forward, module)
    return model


def compile_blocks(model, **compile_kwargs):
    """torch.compile each decoder block in place (nn.Module.compile keeps FQNs); returns the model."""
    for block in decoder_blocks(model):
        block.compile(**compile_kwargs)
    return model
