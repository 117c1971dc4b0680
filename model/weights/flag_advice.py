"""Weights problems worded as the flags that fix them: model/ says what does not fit in the model's terms (a
WeightsError's `fix`: a MiniMindConfig field and its value, or a word of shapes.FIXES); this module names the
flag. The model flags are named after the config fields they set (--hidden_size sets hidden_size)."""
from model.weights.shapes import shape_mismatch

# advice for the fixes that are not one model flag (shapes.FIXES)
ADVICE = {
    "tokenizer": lambda vocab: f"pass the tokenizer these weights were trained with (vocab_size {vocab}): "
                               "--tokenizer_path",
    "lora_adapters": lambda _: "pass the base model here and the adapters to --lora (eval_llm.py, convert_model.py)",
    "model_fields": lambda _: "pass the model flags these weights were trained with",
    "moe_layout": lambda _: "check --use_moe / shared experts",
    "minimind_format": lambda _: "export with --format minimind instead",
}

def weights_line(error):
    """The one line to show for `error`: its message, and for a WeightsError with a fix the flag that makes the
    weights usable ("...; pass --intermediate_size 2432")."""
    fix = getattr(error, "fix", None)
    if fix is None:
        return str(error)
    setting, value = fix
    return f"{error}; {ADVICE[setting](value) if setting in ADVICE else f'pass --{setting} {value}'}"


def mismatch_line(state_dict, model, path):
    """None if `state_dict` loads strict into `model`, else one line naming the file, tensor, shapes and the flag."""
    mismatch = shape_mismatch(state_dict, model, path)
    return weights_line(mismatch) if mismatch else None


def flag_conflicts(fields, flags):
    """One '--name value (the weights have w)' per given flag (not None) that disagrees with the weights' fields."""
    return [f"--{name} {value} (the weights have {fields[name]})" for name, value in flags.items()
            if value is not None and name in fields and fields[name] != value]
