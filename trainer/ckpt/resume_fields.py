"""A resume checks every flag that shaped the saved state against the checkpoint (ARCHITECTURE.md, contracts).

The model's fields are checked by checkpoint.check_config; these are the rest, by flag: the tokenizer (its record,
compared by the sha256 of tokenizer.json) and what a stage declares in `resume_fields()` (LoRA: rank, alpha, targets,
dropout; DPO: beta and the reference; distillation: the teacher, alpha, temperature). Checkpoints save them as
`resume_fields` in train_state.pt; a value that differs now is one line naming the flag and both values.
"""
from model.provenance import short
from trainer.base.errors import ConfigError


def resume_fields(plan):
    """What shapes the saved state besides the model's fields, by flag: the tokenizer (its record) and the stage's
    own (LoRA rank/alpha/targets/dropout, DPO beta and reference, distillation teacher/alpha/temperature)."""
    fields = {"--tokenizer_path": plan.data.tokenizer_record}
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
