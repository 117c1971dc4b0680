"""The resume checkpoint, a DCP directory per save: its one writer (Checkpointer.save, trainer/ckpt/checkpointer.py)
and reader (read_resume here before the model is built, Checkpointer.load once it is wrapped; read_checkpoint_model /
read_checkpoint_record for a step directory named as weights).
  <checkpoint_dir>/<weight>_<hidden>[_moe]/step_<N>/
      __*.distcp, .metadata   model + optimizer (sharded_state_dict: FQN-keyed, DTensor shards stay shards)
      train_state.pt          rank 0: the rank-0 parts (train_state: TrainState, scaler, callbacks) and the record:
                              format_version, parts, world_size, global_batch, layout, args (the flags as typed),
                              config, tokenizer, resume_fields
      rng_<rank>.pt           each rank's own files (trainer/ckpt/step_dirs.py): RNG states; the objective's state,
      objective_<rank>.pt       where it has one (GRPO: a rollout being reused); PowerSGD's residuals and Qs
      powersgd_<rank>.pt        (--grad_compression powersgd)
      crc32_<rank>.json       each rank's crc32 of the shards it wrote, taken as it wrote them
      complete.json           written last, by rank 0, once every rank's files are there: only then it counts; every
                              file's size and crc32, checked before a step is loaded (step_dirs.damage)
The parts are a registry (trainer/ckpt/parts.py): each registers once with its scope, save and load walk it.
DCP reshards on load, so a run may resume under another layout. The weights file: trainer/ckpt/weights_file.py.
MiniMind's own <checkpoint_dir>/<weight>_<hidden>[_moe]_resume.pth resumes when no directory checkpoint exists
(trainer/ckpt/minimind_resume.py). The resume's check of the flags that shaped the saved state is at the end.
"""
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from model.errors import ConfigError
from model.provenance import short
from model.weights.shapes import WeightsError, clean_state_dict, config_fields
from trainer.base.log import Logger
from trainer.ckpt.step_dirs import (
    FORMAT_VERSION,
    MANIFEST,
    TRAIN_STATE,
    agreed_checkpoint,
    agreed_damage,
    damage,
    latest_checkpoint,
    load_train_state,
    loadable_checkpoint,
    minimind_resume_path,
)
from trainer.parallel.state_dict import TIED_EMBEDDING

# one process saves and loads without a process group, as intended: DCP warns about it on every save
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
CHECK_KEYS = ("hidden_size", "num_hidden_layers", "use_moe", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "num_experts")


@dataclass
class TrainState:
    """Where training stands: what resume restores besides model, optimizer, scaler and RNG."""
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    tokens_seen: int = 0  # cumulative target tokens over all ranks
    tracker_id: Optional[str] = None

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def check_config(saved, config, path, tokenizer=None):
    """ConfigError naming the first model field the checkpoint was saved with differently (vocab_size: the tokenizer
    it was trained with, from its record `tokenizer`, since no flag sets it)."""
    for key in CHECK_KEYS:
        if saved.get(key) != getattr(config, key):
            tokenizer_path = (tokenizer or {}).get("path") or "of that run"
            fix = "match the flags" if key != "vocab_size" else \
                f"vocab_size follows the tokenizer: pass --tokenizer_path {tokenizer_path}"
            raise ConfigError(f"{path} was saved with {key}={saved.get(key)} but this run has "
                              f"{key}={getattr(config, key)}; {fix} or pass --from_resume 0")


def _read_train_state(path, config):
    """train_state.pt of a complete DCP checkpoint, checked against this run's model (ConfigError if unusable)."""
    try:
        ckpt = load_train_state(path)
        saved, version = ckpt["config"], ckpt["format_version"]
    except Exception as e:
        raise ConfigError(f"{os.path.join(path, TRAIN_STATE)} is not a readable checkpoint ({type(e).__name__}); "
                          f"delete {path} or pass --from_resume 0")
    if version > FORMAT_VERSION:  # a newer directory layout; older ones (1, 2) were single files
        raise ConfigError(f"{path} has checkpoint format {version}, this trainer reads up to {FORMAT_VERSION}; "
                          "update the code or pass --from_resume 0")
    check_config(saved, config, path, ckpt.get("tokenizer"))
    return dict(ckpt, dcp_path=path)


def saved_resume_fields(plan):
    """(path, resume fields) of the checkpoint --from_resume would load; (None, None) without one."""
    path = loadable_checkpoint(plan.io.run_dir) if plan.io.from_resume != "0" else None
    try:
        return path, load_train_state(path).get("resume_fields") if path else None
    except Exception:
        return path, None  # read_resume names the unreadable file


def check_resume_early(plan):
    """--from_resume 1 with nothing to resume fails here, before the data is built and tokenized (read_resume's own
    check comes after them); one process only: ranks on nodes without a shared directory see different files, and
    read_resume's collective agreement names each rank's view (files alone would let one rank leave the others)."""
    io = plan.io
    if plan.layout.world_size > 1:
        return
    minimind_path = minimind_resume_path(io.checkpoint_dir, os.path.basename(io.run_dir))
    if io.from_resume == "1" and not io.resume_path and latest_checkpoint(io.run_dir) is None \
            and not os.path.isfile(minimind_path):
        raise ConfigError(f"--from_resume 1 but {io.run_dir} holds no complete checkpoint; pass --from_resume auto "
                          "to start fresh when there is none, or 0")


def read_resume(config, plan):
    """--from_resume 1/auto, before the model is built: the newest complete checkpoint's own state (train_state.pt of
    a DCP directory, else MiniMind's resume file, whose model the plain model loads), checked against this run;
    Checkpointer.load restores it once the model is wrapped.

    None for --from_resume 0, or auto with nothing to resume; --from_resume 1 with nothing is a ConfigError.
    Its global batch must match this run's.
    """
    if plan.io.from_resume == "0":
        return None
    path = plan.io.resume_path or agreed_checkpoint(plan.io.run_dir)  # --from_resume <step dir>: that one
    why = agreed_damage(path) if plan.io.resume_path else None
    if why:
        raise ConfigError(f"--from_resume {path}: {os.path.join(path, why)}; name another step directory, or pass "
                          "--from_resume 1 for the newest one that loads")
    minimind_path = minimind_resume_path(plan.io.checkpoint_dir, os.path.basename(plan.io.run_dir))
    ckpt = _read_train_state(path, config) if path else None
    if ckpt is None and os.path.isfile(minimind_path):
        from trainer.ckpt.minimind_resume import read_minimind_resume  # MiniMind's own file: read when one is there
        ckpt = read_minimind_resume(minimind_path, config, plan)
    if ckpt is None:
        if plan.io.from_resume == "1":
            raise ConfigError(f"--from_resume 1 but {plan.io.run_dir} holds no complete checkpoint; pass --from_resume "
                              "auto to start fresh when there is none, or 0")
        Logger(f"--from_resume auto: no complete checkpoint in {plan.io.run_dir}, starting fresh")
        return None
    check_resume_fields(ckpt.get("resume_fields"), plan, path or minimind_path)
    if ckpt["global_batch"] != plan.data.global_batch:
        raise ConfigError(f"checkpoint was saved with a global batch of {ckpt['global_batch']} samples, this run "
                          f"has {plan.data.global_batch} (batch_size x accumulation_steps x dp); match it to resume "
                          "exactly")
    Logger(f"Resuming from {path or minimind_path}")
    return ckpt


def read_checkpoint_model(path):
    """(state_dict, config fields, typed args) of a step directory's model, whatever layout saved it: the full
    tensors from every rank's shards, in this one process (eval_llm --checkpoint, convert_model, --from_weight)."""
    why = damage(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None  # sizes and crc32 recorded at save
    if why:
        raise WeightsError(f"{os.path.join(path, why)}: the checkpoint is damaged; pass another step_<N> directory")
    try:
        reader = FileSystemReader(path)
        model = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)  # saved as {"model": ...}
                 for key, meta in reader.read_metadata().state_dict_metadata.items()
                 if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
        saved = load_train_state(path)
    except Exception as e:
        raise WeightsError(f"{path} is not a readable resume checkpoint ({type(e).__name__}); pass a complete "
                           "step_<N> directory, a .pth or an HF folder") from None
    return clean_state_dict(model), config_fields(saved["config"]), saved.get("args")


def read_checkpoint_record(path):
    """What a step directory records besides the model: {"tokenizer": {"path", "sha256"} (older ones: the typed
    --tokenizer_path only), "step": N}; {} when train_state.pt is unreadable (read_checkpoint_model names it)."""
    try:
        saved = load_train_state(path)
    except Exception:
        return {}
    tokenizer = saved.get("tokenizer") or {"path": (saved.get("args") or {}).get("tokenizer_path"), "sha256": None}
    return {"tokenizer": tokenizer if tokenizer["path"] else None,
            "step": (saved.get("train_state") or {}).get("global_step")}


def tied_aliases(pipeline, config):
    """Under pp the tied embedding has a copy on the last stage; its optimizer state is saved once."""
    return TIED_EMBEDDING if pipeline is not None and config.tie_word_embeddings else None


# ----------------------------------------------------------------------------- the flags that shaped the saved state
# A resume checks every flag that shaped the saved state against the checkpoint (ARCHITECTURE.md, contracts). The
# model's fields are checked by check_config; these are the rest, by flag: the tokenizer (its record, compared by the
# sha256 of tokenizer.json) and what a stage declares in `resume_fields()` (LoRA: rank, alpha, targets, dropout; DPO:
# beta and the reference; distillation: the teacher, alpha, temperature). Checkpoints save them as `resume_fields` in
# train_state.pt; a value that differs now is one line naming the flag and both values.
def resume_fields(plan):
    """What shapes the saved state besides the model's fields, by flag: the tokenizer (its record), the optimizer (its
    state's entries) and the stage's own (LoRA rank/alpha/targets/dropout, DPO beta and reference, distillation
    teacher/alpha/temperature)."""
    fields = {"--tokenizer_path": plan.data.tokenizer_record, "--optimizer": plan.optim.name}
    if plan.model.config.use_moe:  # the routing bias is model state when on
        fields["--router_balance"] = plan.model.router_balance
    return dict(fields, **plan.stage.resume_fields())


def _shown(value):
    """A resume field as the user reads it: a file record as its path and content hash."""
    return f"{value['path']} (sha256 {short(value['sha256'])})" if isinstance(value, dict) else str(value)


def _same(saved, value):
    """Equal resume fields; file records compare by content (by path where a hash is missing)."""
    if isinstance(saved, dict) and isinstance(value, dict):
        key = "sha256" if saved.get("sha256") and value.get("sha256") else "path"
        return saved.get(key) == value.get(key)
    return saved == value


def check_resume_fields(saved, plan, path):
    """ConfigError naming the first flag that shaped the checkpoint's state and has another value in this run."""
    if not saved:  # MiniMind's resume file, or a checkpoint from before these were saved
        return
    for flag, value in resume_fields(plan).items():
        if flag in saved and not _same(saved[flag], value):
            was = saved[flag]
            typed = was["path"] if isinstance(was, dict) else was
            hint = f"leave {flag} out" if was is None else f"pass {flag} {typed}"
            raise ConfigError(f"{path} was saved with {flag} {_shown(was)}, this run has {flag} {_shown(value)}; "
                              f"{hint} to continue it, or --from_resume 0 to start over")
