"""The LoRA stage's plan (trainer/plan/stage.py): checked flags, the adapters put on the loaded base, and the adapter
files it writes.

The loss, data and evaluation are SFT's unchanged; what differs is the model (base frozen, adapters trained) and the
weights file (only the adapters: MiniMind's format plus a PEFT folder). Resume checkpoints hold the whole model.
"""
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from model.errors import ConfigError
from model.lora import TARGETS, LoraError, apply_lora, lora_state_dict, lora_target_names, save_peft
from model.model_minimind import MiniMindForCausalLM
from model.provenance import tokenizer_files
from model.weights.files import save_weights_file
from model.weights.paths import weight_name
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.plan.stage import SIDECAR_BYTES
from trainer.stages.sft import SFTStage


@dataclass(frozen=True)
class LoraPlan(SFTStage):
    """--lora_* flags, checked, and where the adapters go."""
    rank: int
    alpha: float
    dropout: float
    targets: Optional[tuple]  # short names (q_proj, ...); None: MiniMind's square layers
    lora_name: str
    adapter_path: str  # <save_dir>/lora/<name>_<hidden>[_moe].pth, MiniMind's format
    peft_dir: str  # <save_dir>/lora/<name>_<hidden>[_moe]_peft
    base_weight: str  # --from_weight, recorded in the sidecar and PEFT's base_model_name_or_path
    name = "LoRA"
    FLAGS = (
        Flag("lora_name", str, "lora_identity", "adapter name: <save_dir>/lora/<lora_name>_<hidden>[_moe].pth "
             "(MiniMind's format) and a PEFT folder <lora_name>_<hidden>[_moe]_peft beside it"),
        Flag("lora_rank", int, 16, "rank of each adapter (A: in -> rank, B: rank -> out)", min=1,
             hint="MiniMind uses 16"),
        Flag("lora_alpha", float, None, "scale = alpha / rank (default: alpha = rank, MiniMind's scale 1)"),
        Flag("lora_dropout", float, 0.0, "dropout on the adapters' input"),
        Flag("lora_targets", str, None, "comma list of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (MoE "
             "experts included; default: MiniMind's choice, every square linear layer)"),
    )

    @classmethod
    def resolve(cls, args, plan):
        return resolve_lora(args, plan)

    def prepare_model(self, model):
        """Attach the adapters to the plain, loaded model and freeze its base (before parallelizing)."""
        names = apply_lora(model, self.rank, self.alpha, self.dropout, self.targets)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        layers = {re.search(r"layers\.(\d+)\.", name).group(1) for name in names}
        kinds = sorted({name.rsplit(".", 1)[-1] for name in names})
        Logger(f"LoRA rank {self.rank} alpha {self.alpha} on {len(names)} modules ({', '.join(kinds)} in "
               f"{len(layers)} layers): {trained / 1e6:.3f}M trainable parameters of {total / 1e6:.2f}M "
               f"({100 * trained / total:.2f}%)")
        return model

    def weights_path(self, plan):
        """The adapters' file, MiniMind's format (the PEFT folder beside it)."""
        return self.adapter_path

    def best_weights_path(self, plan):
        return None  # --save_best keeps the best checkpoint; its adapters are exported from it

    def save_weights(self, model_state, config, save_dtype, record, path):
        """Rank 0: the adapters of a gathered model state dict, in MiniMind's format at `path` (+ its sidecar: the
        model fields, `record` (tokenizer, step) and the adapters' own) and PEFT's (+ the tokenizer files)."""
        model = MiniMindForCausalLM(config)
        apply_lora(model, self.rank, self.alpha, self.dropout, self.targets)
        model.load_state_dict(model_state)
        model.to(save_dtype)
        lora = dict(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=list(self.targets or ()),
                    base_weight=self.base_weight)
        try:
            save_peft(model, self.peft_dir, base_model_name_or_path=self.base_weight,
                      tokenizer_path=(record.get("tokenizer") or {}).get("path"))
        except LoraError as e:  # MoE expert targets: transformers 5 fuses experts, PEFT has no layer to adapt
            Logger(f"PEFT export skipped: {e}")
        # last: the sidecar's step says every file of this save is written (a resume rewrites them otherwise)
        save_weights_file(lora_state_dict(model), config, path, dict(record, lora=lora))

    def weights_bytes(self, model_state, save_dtype, record):
        """What save_weights writes, about: the adapters twice (MiniMind's file, PEFT's), the tokenizer, sidecars."""
        adapters = sum(v.numel() for k, v in model_state.items() if ".lora." in k) * save_dtype.itemsize
        folder = (record.get("tokenizer") or {}).get("path")
        tokenizer = sum(os.path.getsize(os.path.join(folder, n)) for n in tokenizer_files(folder)) if folder else 0
        return 2 * adapters + tokenizer + SIDECAR_BYTES

    def resume_fields(self):
        """The flags that shape the saved state (checked on resume, trainer/ckpt/resume.py)."""
        return {"--lora_rank": self.rank, "--lora_alpha": self.alpha, "--lora_dropout": self.dropout,
                "--lora_targets": ",".join(self.targets) if self.targets else None}


def parse_targets(spec):
    """--lora_targets 'q_proj,o_proj' -> ('o_proj', 'q_proj'); None or '' -> None (MiniMind's square layers)."""
    if not spec:
        return None
    names = tuple(sorted({name.strip() for name in spec.split(",") if name.strip()}))
    unknown = [name for name in names if name not in TARGETS]
    if unknown or not names:
        raise ConfigError(f"--lora_targets {spec!r}: {unknown[0] if unknown else 'empty'} is not one of "
                          f"{','.join(TARGETS)}")
    return names


def resolve_lora(args, plan):
    """The checked LoraPlan; a bad --lora_* flag, or targets no layer of the model matches, is a ConfigError."""
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise ConfigError(f"--lora_alpha must be positive (got {args.lora_alpha}); leave it out for alpha = rank")
    if not 0 <= args.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout must be in [0, 1) (got {args.lora_dropout})")
    if not args.lora_name or os.sep in args.lora_name:
        raise ConfigError(f"--lora_name must be a plain file name (got {args.lora_name!r})")
    if plan.model.from_weight == "none":
        Logger("--from_weight none: LoRA on a randomly initialised base (pass --from_weight full_sft or a .pth)")
    targets = parse_targets(args.lora_targets)
    with torch.device("meta"):  # only the layer names and shapes: no memory, no init
        model = MiniMindForCausalLM(plan.model.config)
    try:
        lora_target_names(model, targets)
    except LoraError as e:
        raise ConfigError(f"--lora_targets: {e}") from None
    stem = weight_name(args.lora_name, plan.model.config)
    folder = os.path.join(plan.io.save_dir, "lora")
    return LoraPlan(rank=args.lora_rank, alpha=float(args.lora_rank if args.lora_alpha is None else args.lora_alpha),
                    dropout=args.lora_dropout, targets=targets, lora_name=args.lora_name,
                    adapter_path=os.path.join(folder, stem + ".pth"), peft_dir=os.path.join(folder, stem + "_peft"),
                    base_weight=plan.model.from_weight)
