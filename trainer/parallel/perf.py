"""Speed and memory transforms applied to a plain (or tp/cp-wrapped) model, keeping parameter names unchanged.

- `apply_activation_checkpointing(model)`: each decoder block recomputes its activations in backward
  (torch.utils.checkpoint, non-reentrant). The block's `forward` is patched in place instead of wrapping
  the block (torch's checkpoint_wrapper would add `_checkpoint_wrapped_module.` to every FQN, and our
  checkpoints are keyed by FQN).
- `compile_blocks(model)`: torch.compile each decoder block in place (`nn.Module.compile`, same FQNs).

Order in parallelize.parallelize: pp split -> tp -> cp -> activation checkpointing -> compile -> dp.
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


def apply_activation_checkpointing(model):
    """Recompute every decoder block in backward; returns the model. Parameter FQNs do not change."""
    for block in decoder_blocks(model):
        # a bound method in the instance dict: deepcopy rebinds it to the copy, state_dict never sees it
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def compile_blocks(model, **compile_kwargs):
    """torch.compile each decoder block in place (nn.Module.compile keeps FQNs); returns the model."""
    for block in decoder_blocks(model):
        block.compile(**compile_kwargs)
    return model
