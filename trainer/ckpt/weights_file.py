"""The run's weights file, and any weights a flag names (init_model: MiniMind's model, from --from_weight).

Out: save_weights gathers the full model (a collective) and rank 0 writes what the stage's weights hooks say
(trainer/plan/stage.py: MiniMind's plain `.pth` + sidecar, or LoRA's adapters); ensure_final_weights rewrites them on a
resume that finds the last step's missing. In: read_any_weights / any_weights_record / load_any_weights take what
--from_weight, --ref_weight, --teacher_path, eval_llm and convert_model name: a checkpoint directory (read by
trainer/ckpt/resume.py, its owner), else a .pth, a single-file resume or an HF folder (model/weights/files.py).
"""
import os

from model.errors import ConfigError
from model.model_minimind import MiniMindForCausalLM
from model.weights.files import is_checkpoint_dir, read_record, read_weights_and_args
from model.weights.flag_advice import weights_line
from model.weights.paths import file_digest
from model.weights.shapes import WeightsError, load_checked
from trainer.base.launch import count_sum, is_main_process
from trainer.base.log import Logger
from trainer.ckpt.resume import read_checkpoint_model, read_checkpoint_record
from trainer.ckpt.step_dirs import latest_checkpoint, set_rng_state
from trainer.ckpt.storage import rank0_write
from trainer.parallel.state_dict import full_model_state_dict


def init_model(config, from_weight="none", device="cpu", role="Model", note=None):
    """MiniMind's model; loads `from_weight` (a .pth, a step directory or an HF folder, resolved by config.resolve)
    unless 'none'. Its line names the `role` (a reference model beside the policy) and where the weights come from
    (`note`: a resume's checkpoint, which loads later)."""
    model = MiniMindForCausalLM(config)
    if from_weight != "none":
        try:
            load_any_weights(model, from_weight)  # strict; a mismatch names the file, tensor, both shapes and the flag
        except WeightsError as e:
            raise ConfigError(weights_line(e)) from None
    source = note or (f"weights {from_weight}{file_digest(from_weight)}" if from_weight != "none" else
                      "initialised from --seed")
    base = base_record(from_weight) if note is None else None
    if unfinished_line(base):
        source += f", unfinished: step {base['step']} of {base['total_steps']}"
        if role == "Model":  # once: a reference or teacher read from the same file adds it to its own line only
            Logger(unfinished_line(base))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    Logger(f"{role} params: {params:.2f}M (vocab {config.vocab_size:,}), {source}")
    return model.to(device)


def base_record(path):
    """What the weights at `path` record of the run that wrote them: {"path", "step", "total_steps", "finished"} as
    far as known; None for "none". A run started from them writes it into its own sidecar ("from_weight")."""
    if path == "none":
        return None
    record = any_weights_record(path)
    return dict(path=path, **{k: record[k] for k in ("step", "total_steps", "finished") if k in record})


def unfinished_line(base):
    """One line when `base` (base_record) comes from a run that stopped before its planned end, else None."""
    if not base or base.get("finished") is not False:
        return None
    return (f"note: {base['path']} holds step {base['step']} of {base['total_steps']} of a run stopped before its "
            "end; to finish it first, rerun that run's command with --from_resume 1")


def read_any_weights(path):
    """(state_dict, config fields or None, saved training args or None) of `path`; WeightsError in one line."""
    return read_checkpoint_model(path) if is_checkpoint_dir(path) else read_weights_and_args(path)


def any_weights_record(path):
    """What the weights at `path` record besides the model ({"tokenizer", "step", ...}, as far as known)."""
    return read_checkpoint_record(path) if is_checkpoint_dir(path) else read_record(path)


def load_any_weights(model, path):
    """Read `path`, check it against `model` and load it strict (fp32 copy); WeightsError (with its fix) if it does not
    fit (model/weights/flag_advice.weights_line words it)."""
    state_dict, _, _ = read_any_weights(path)
    return load_checked(model, state_dict, path)


def save_weights(trainer, path=None, finished=None):
    """Gather the full model (a collective) and write the stage's weights on rank 0 (trainer/plan/stage.py: MiniMind's
    plain weights file in --save_dtype, or the stage's own files, LoRA's adapters) at `path` (default: the stage's
    weights path), its sidecar recording the tokenizer, the step of the planned total, whether the run finished
    (default: not stopped by a signal and at the total; the loop says so for an early stop) and the weights it started
    from. A disk without room stops every rank with one line (DiskFullError)."""
    plan, stage = trainer.plan, trainer.plan.stage
    pp_group = trainer.dims.group("pp") if plan.layout.pp > 1 else None
    # each ep rank holds its stage's experts (group("ep") is None without expert parallel)
    model_sd = full_model_state_dict(trainer.model_parts, pp_group=pp_group, ep_group=trainer.dims.group("ep"))
    path = path or stage.weights_path(plan)
    step = trainer.progress.global_step
    if finished is None:
        finished = not trainer.guard.stop and step >= trainer.total_steps
    record = dict(tokenizer=plan.data.tokenizer_record, step=step, total_steps=trainer.total_steps,
                  finished=bool(finished), **({"from_weight": trainer.from_weight} if trainer.from_weight else {}))
    needed = stage.weights_bytes(model_sd, plan.io.save_dtype, record) if is_main_process() else 0
    rank0_write(os.path.dirname(path), needed, path, "--save_dir",
                lambda: stage.save_weights(model_sd, trainer.config, plan.io.save_dtype, record, path),
                latest_checkpoint(plan.io.run_dir))


def ensure_final_weights(trainer):
    """A resume that finds --max_steps reached: the weights file must be this step's (its sidecar says which step it
    holds); a save that failed before (a full disk) is written now. Every rank takes rank 0's decision."""
    path, step = trainer.plan.stage.weights_path(trainer.plan), trainer.progress.global_step
    held = read_record(path).get("step") if os.path.isfile(path) else None
    if count_sum(int(held != step) if is_main_process() else 0):
        now = f"holds step {held}" if held is not None else "records no step" if os.path.isfile(path) else "is missing"
        Logger(f"{path} {now}, not the final step {step}: writing them")
        save_weights(trainer, finished=True)


def save_last_completed(trainer):
    """One process stopped inside a step (a signal, a failing reward function): drop the step's gradients and save the
    last completed step (its parameters, optimizer state and progress are untouched) with the RNG state it ended with,
    then the weights. Returns that step (0: none completed, nothing saved)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    guard, step = trainer.guard, trainer.progress.global_step
    if step == 0:
        return 0
    if trainer.step_rng is not None:
        set_rng_state(trainer.step_rng)
    if guard.last_save != step:  # else that step's checkpoint is on disk already
        trainer.checkpointer.save(step)
        guard.saved(step)
        trainer.callbacks.call("on_save", trainer, step)
    trainer.checkpointer.wait()
    save_weights(trainer, finished=False)  # as a preempted run leaves them
    return step
