"""LoRA adapters attached from outside to a plain model, saved in MiniMind's format and in PEFT's.

Each adapted nn.Linear `parent.<name>` gets an adapter `parent.lora[<name>]` (A: in -> rank, B: rank -> out, plain
nn.Linear so tensor-parallel plans shard them like the base, see lora_tp_plan) and a forward hook adding
`scale * B(A(dropout(x)))` to its output. The adapter sits beside the base, not inside it, because torch's
Colwise/RowwiseParallel shard every parameter of the module they are given.
scale = alpha / rank as in PEFT; MiniMind's own LoRA has no scaling, so its files hold B * scale.
"""
import os
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from model.atomic import atomic_folder, atomic_save
from model.hf_convert import minimind_to_hf
from model.provenance import copy_tokenizer
from model.weights.shapes import clean_state_dict

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be applied, loaded or exported: the message is one line saying what to change."""


class LoRA(nn.Module):
    """The low-rank update B(A(x)) * scale; B starts at zero so an untrained adapter leaves the base unchanged."""

    def __init__(self, in_features, out_features, rank, alpha, dropout=0.0):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.normal_(self.A.weight, mean=0.0, std=0.02)  # MiniMind's init
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.B(self.A(self.dropout(x))) * self.scale


def _add_lora(adapter, module, args, output):
    return output + adapter(args[0])


def lora_target_names(model, targets=None):
    """Names of the nn.Linear layers to adapt: `targets` (short names from TARGETS), or MiniMind's square ones."""
    unknown = sorted(set(targets or ()) - set(TARGETS))
    if unknown:
        raise LoraError(f"LoRA target {unknown[0]!r} is not one of {', '.join(TARGETS)}")
    names = []
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear) or short not in TARGETS:
            continue
        square = module.weight.shape[0] == module.weight.shape[1]
        if (short in targets) if targets else square:
            names.append(name)
    if not names:
        raise LoraError(f"no layer of the model matches LoRA targets {list(targets or ['square linear layers'])}; "
                        f"pick from {', '.join(TARGETS)}")
    return names


def apply_lora(model, rank=16, alpha=None, dropout=0.0, targets=None):
    """Freeze `model` and attach adapters (alpha defaults to rank: scale 1, MiniMind's math); returns their names."""
    if rank < 1:
        raise LoraError(f"LoRA rank must be at least 1 (got {rank})")
    if alpha is not None and not alpha > 0:
        raise LoraError(f"LoRA alpha must be positive (got {alpha})")
    if not 0 <= dropout < 1:
        raise LoraError(f"LoRA dropout must be in [0, 1) (got {dropout})")
    names = lora_target_names(model, targets)
    if any(name in lora_modules(model) for name in names):
        raise LoraError("the model already has LoRA adapters on these layers; apply_lora once (merge_lora first)")
    for name in names:
        parent_name, _, short = name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(name)
        if "lora" not in parent._modules:
            parent.lora = nn.ModuleDict()
        weight = module.weight
        adapter = LoRA(weight.shape[1], weight.shape[0], rank, rank if alpha is None else alpha, dropout)
        parent.lora[short] = adapter.to(device=weight.device, dtype=weight.dtype)
        module._lora_hook = module.register_forward_hook(partial(_add_lora, adapter))
    freeze_base(model)
    return names


def freeze_base(model):
    """Only the adapters train; call again after tensor parallelism (some styles re-create parameters trainable)."""
    adapters = {id(p) for _, _, _, adapter in _adapters(model) for p in adapter.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in adapters)


def _adapters(model):
    """(base name as in model, parent, base layer's attribute name, adapter) for every adapted layer."""
    for parent_name, parent in model.named_modules():
        adapters = parent._modules.get("lora")
        if isinstance(adapters, nn.ModuleDict):
            for short, adapter in adapters.items():
                yield f"{parent_name}.{short}" if parent_name else short, parent, short, adapter


def lora_modules(model):
    """{clean base layer name: (base nn.Linear, LoRA)} (DDP / torch.compile prefixes dropped)."""
    modules = {}
    for name, parent, short, adapter in _adapters(model):
        for prefix in ("module.", "_orig_mod."):
            name = name.removeprefix(prefix)
        modules[name] = (getattr(parent, short), adapter)
    return modules


def _require_lora(model):
    modules = lora_modules(model)
    if not modules:
        raise LoraError("the model has no LoRA adapters; call apply_lora(model, ...) first")
    return modules


def lora_state_dict(model):
    """MiniMind's format: `<module>.lora.A.weight` / `<module>.lora.B.weight`, B holding the scale."""
    state = {}
    for name, (_, lora) in _require_lora(model).items():
        state[f"{name}.lora.A.weight"] = lora.A.weight.detach().cpu().clone()
        state[f"{name}.lora.B.weight"] = (lora.B.weight.detach() * lora.scale).cpu()
    return state


def save_lora(model, path):
    """Write the adapters to `path` (.pth) in MiniMind's format, which MiniMind's load_lora reads (atomically)."""
    atomic_save(lora_state_dict(model), path)


def _read_lora_file(path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise LoraError(f"{path} is not a readable LoRA .pth ({type(e).__name__}); pass a file save_lora wrote")
    if not isinstance(state, dict) or not state or not all(k.endswith((".lora.A.weight", ".lora.B.weight"))
                                                           for k in state):
        raise LoraError(f"{path} holds no MiniMind LoRA keys (<module>.lora.A.weight); pass a file save_lora wrote")
    return clean_state_dict(state)


def apply_lora_file(model, path):
    """apply_lora with the rank and targets a MiniMind-format file shows, then load it."""
    state = _read_lora_file(path)
    a_keys = [k for k in state if k.endswith(".lora.A.weight")]
    targets = sorted({k.removesuffix(".lora.A.weight").rsplit(".", 1)[-1] for k in a_keys})
    rank = state[a_keys[0]].shape[0]
    apply_lora(model, rank=rank, targets=targets)  # alpha = rank: the file's B already holds the scale
    return load_lora(model, path)


def load_lora(model, path):
    """Load a MiniMind-format adapter file into a model prepared by apply_lora; LoraError(one line) on mismatch."""
    state = _read_lora_file(path)
    modules = _require_lora(model)
    expected = {f"{name}.lora.{ab}.weight" for name in modules for ab in "AB"}
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model has no adapter for"
        raise LoraError(f"{path} {what}; apply_lora with the targets and rank the adapter was trained with")
    for name, (_, lora) in modules.items():
        a, b = state[f"{name}.lora.A.weight"], state[f"{name}.lora.B.weight"]
        if a.shape != lora.A.weight.shape or b.shape != lora.B.weight.shape:
            raise LoraError(f"{path}: {name}.lora.A.weight has shape {list(a.shape)}, the model's adapter "
                            f"{list(lora.A.weight.shape)}; pass the rank and model the adapter was trained with")
        with torch.no_grad():
            lora.A.weight.copy_(a)
            lora.B.weight.copy_(b / lora.scale)  # the file holds B * scale
    return model


def merge_lora(model):
    """Fold scale * B @ A into each base weight and remove the adapters; the model is plain again."""
    _require_lora(model)
    for _, parent, short, lora in list(_adapters(model)):
        module = getattr(parent, short)
        with torch.no_grad():
            delta = lora.B.weight.float() @ lora.A.weight.float() * lora.scale
            module.weight.add_(delta.to(module.weight.dtype))
        module._lora_hook.remove()
        del module._lora_hook, parent.lora[short]
        if not len(parent.lora):
            del parent.lora
    return model


def save_peft(model, out_dir, base_model_name_or_path=None, tokenizer_path=None):
    """Write adapter_config.json + adapter_model.safetensors for peft.PeftModel on our Hugging Face export, and the
    tokenizer files of `tokenizer_path` beside them; the folder is replaced as a whole (atomic_folder)."""
    from peft import LoraConfig  # optional dependency: only the PEFT export needs it
    from safetensors.torch import save_file
    modules = _require_lora(model)
    hf_names = set(minimind_to_hf(model.state_dict(), model.config)[1])
    ranks = {(lora.rank, lora.alpha) for _, lora in modules.values()}
    for name in modules:
        if f"{name}.weight" not in hf_names:
            raise LoraError(f"{name} has no nn.Linear in the Hugging Face export (fused experts in this transformers); "
                            "save this adapter with save_lora (MiniMind format) or merge it")
    if len(ranks) != 1:
        raise LoraError("adapters with different rank/alpha per layer do not fit one PEFT adapter_config")
    (rank, alpha), = ranks
    first = next(iter(modules.values()))[1]
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(modules),
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path)
    tensors = {}
    for name, (_, lora) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora.A.weight.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = lora.B.weight.detach().cpu().contiguous()
    with atomic_folder(out_dir) as tmp:
        config.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        if tokenizer_path:
            copy_tokenizer(tokenizer_path, tmp)
    return out_dir


class ReplicateWeights(ParallelStyle):
    """Parameters become Replicate DTensors; DTensor inputs and outputs pass through, so Partial stays Partial."""

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh)


def lora_tp_plan(model, base_plan):
    """TP plan entries for the adapters of the layers `base_plan` shards; call apply_lora before parallelizing.

    Colwise base: A replicated, B sharded on its output (the base output's Shard(-1)).
    Rowwise base: A sharded on its input, B replicated; the adapter output stays Partial and joins the base's
    Partial output before its one reduction.
    """
    plan = {}
    for name, _, _, _ in _adapters(model):
        parent_name, _, short = name.rpartition(".")
        style, adapter = base_plan.get(name), f"{parent_name}.lora.{short}"
        if isinstance(style, ColwiseParallel):
            plan[f"{adapter}.A"] = ReplicateWeights()
            plan[f"{adapter}.B"] = ColwiseParallel(input_layouts=Replicate(), use_local_output=False)
        elif isinstance(style, RowwiseParallel):
            plan[f"{adapter}.A"] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial(),
                                                   use_local_output=False)
            plan[f"{adapter}.B"] = ReplicateWeights()
        else:
            raise LoraError(f"{name} has a LoRA adapter but no column- or row-wise entry in the TP plan")
    return plan
