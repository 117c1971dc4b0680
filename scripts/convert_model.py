"""Convert MiniMind weights to and from Hugging Face folders.

Export (a .pth or a resume checkpoint -> folder: Qwen3 / Qwen3-MoE by default, or MiniMind's own format):
    python scripts/convert_model.py --weight out/pretrain_768.pth --out_dir out/hf_model
    python scripts/convert_model.py --weight checkpoints/full_sft_768/step_1000 --out_dir out/mm --format minimind
Merge a LoRA adapter (MiniMind's format, from trainer/train_lora.py) into the weights, then export; the merged .pth
goes to --merged_weight (default: out/merge_<name>_<hidden>.pth beside --weight, MiniMind's name; an existing one is
replaced only with --overwrite 1, as every export's output):
    python scripts/convert_model.py --weight out/full_sft_768.pth --lora out/lora/lora_identity_768.pth --out_dir out/hf
GGUF for llama.cpp / Ollama (f32, f16, bf16 or q8_0; a Modelfile beside it; see docs/elsewhere.md):
    python scripts/convert_model.py --to gguf --weight out/full_sft_768.pth --out_dir out/gguf --gguf_type q8_0
Import (a Qwen3 / Qwen3-MoE / MiniMind `model_type: minimind` folder -> .pth):
    python scripts/convert_model.py --to minimind --out_dir path/to/folder --weight out/from_hf_768.pth

Every model field comes from the weights (their saved config, else the tensor shapes); flags only fill what a
bare .pth cannot say (top-k, rope_theta) and must agree with the rest. The tokenizer copied is the one the run
used, as the weights record it (path and tokenizer.json's sha256, in the .pth's sidecar or the checkpoint); a
--tokenizer_path whose tokenizer.json differs is refused unless --force_tokenizer 1. After an export the folder is
loaded back with AutoModelForCausalLM and its logits compared with the source model (fp32; above 1e-4: exit 1).
A GGUF is read back after writing and every tensor compared with the source within its type's rounding bound.
Typed relative paths resolve against the current directory, the defaults against the repository root.
"""
import argparse
import copy
import json
import math
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and the converters")

import torch  # noqa: E402
from transformers.dynamic_module_utils import get_relative_import_files  # noqa: E402

from model.atomic import atomic_write_text, files_replaced_in, full_disk_reason  # noqa: E402
from model.errors import ConfigError  # noqa: E402
from model.export.gguf import OUT_TYPES, gguf_refusal, worst_rounding_ratio, write_gguf  # noqa: E402
from model.export.ollama import modelfile, modelfile_target  # noqa: E402
from model.hf_convert import save_hf_folder, save_quietly  # noqa: E402
from model.lora import LoraError, apply_lora_file, merge_lora  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from model.provenance import copy_tokenizer as copy_files  # noqa: E402
from model.provenance import tokenizer_record  # noqa: E402
from model.tokenizer_choice import TokenizerMismatch, tokenizer_for  # noqa: E402
from model.weights.files import read_record, read_weights, save_weights_file, sidecar_path  # noqa: E402
from model.weights.flag_advice import flag_conflicts, weights_line  # noqa: E402
from model.weights.shapes import WeightsError, clean_state_dict, shape_mismatch, weight_fields  # noqa: E402
from trainer.ckpt.weights_file import any_weights_record, base_record, read_any_weights, unfinished_line  # noqa: E402
from trainer.plan.checks import check_writable  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

MAX_LOGIT_DIFF = 1e-4  # fp32 export: only reduction order differs between the two implementations
SHAPE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "moe_intermediate_size", "num_experts")
HIDDEN_FLAGS = ("num_experts_per_tok", "rope_theta")  # not visible in the tensors of a bare .pth


def source_config(state_dict, saved_config, args):
    """MiniMindConfig of the weights: saved config + tensor shapes; flags may only fill in or agree."""
    fields = weight_fields(state_dict, saved_config)
    flags = {name: getattr(args, name) for name in SHAPE_FLAGS + HIDDEN_FLAGS + ("use_moe",)}
    conflicts = flag_conflicts(fields, flags)
    if conflicts:
        raise WeightsError(f"{conflicts[0]}: the model is defined by the weights; drop the flag")
    fields.update({name: value for name, value in flags.items() if value is not None})
    if fields["use_moe"] and "num_experts_per_tok" not in fields:
        raise WeightsError(f"{args.weight} is a MoE .pth without its config (<name>.json beside it), so its top-k "
                           "is unknown; pass --num_experts_per_tok (or export from the resume checkpoint)")
    if "rope_theta" not in fields:
        print(f"note: a .pth without its config does not say rope_theta; using {MiniMindConfig().rope_theta:g} "
              "(the trainer's); --rope_theta to change")
    fields["loss_chunk_size"] = 0  # an inference model returns logits
    return MiniMindConfig(**fields)


def tokenizer_source(args, saved_args):
    """The tokenizer folder the run used, as the weights record it (a .pth's sidecar, a resume checkpoint), else
    --tokenizer_path, else model/ (with a note); a --tokenizer_path other than the recorded one is refused unless
    --force_tokenizer 1."""
    record = any_weights_record(args.weight).get("tokenizer")
    saved = (saved_args or {}).get("tokenizer_path")
    if record is None and saved:  # a single-file resume checkpoint: the typed --tokenizer_path, no hash
        record = {"path": saved if os.path.isabs(saved) or os.path.isdir(saved) else os.path.join(ROOT, saved),
                  "sha256": None}
    path, note = tokenizer_for(record, os.path.abspath(args.tokenizer_path) if args.tokenizer_path else None,
                               os.path.join(ROOT, "model"), f"--weight {args.weight}", bool(args.force_tokenizer))
    if note:
        print(f"note: {note}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise WeightsError(f"{path} holds no tokenizer.json; pass the run's tokenizer folder with --tokenizer_path")
    return path


def copy_tokenizer(src, out_dir):
    print(f"tokenizer: copied {', '.join(copy_files(src, out_dir))} from {src}")


def max_logit_diff(reference, folder, vocab_size, trust_remote_code=False):
    """Load `folder` with AutoModelForCausalLM (fp32) and return max |logits - reference's logits| on a fixed batch."""
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                                  dtype=torch.float32).eval()  # `dtype`: transformers >= 4.56
    ids = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (reference(ids).logits.float() - loaded(ids).logits.float()).abs().max().item()


def source_model(args):
    """(fp32 model with --lora merged, its config, the tokenizer folder, the weights' dtype) of --weight."""
    state_dict, saved_config, saved_args = read_any_weights(args.weight)
    unfinished = unfinished_line(base_record(args.weight))
    if unfinished:  # exported all the same: a user may want the stopped run's weights
        print(unfinished)
    config = source_config(state_dict, saved_config, args)
    if args.to == "gguf" and gguf_refusal(config):
        raise WeightsError(gguf_refusal(config))  # before a LoRA merge writes anything
    tokenizer_dir = tokenizer_source(args, saved_args)
    model = MiniMindForCausalLM(config).eval()
    mismatch = shape_mismatch(state_dict, model, args.weight)
    if mismatch:
        raise mismatch
    state_dict = clean_state_dict(state_dict, True)
    save_dtype = state_dict["model.embed_tokens.weight"].dtype
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    if args.lora:
        model = merged_with_lora(model, config, args, save_dtype, tokenizer_dir)
    return model, config, tokenizer_dir, save_dtype


def remote_code_files():
    """The trust_remote_code modules of a MiniMind-format folder: model/model_minimind.py and the files it imports
    relatively (model/moe.py, model/yarn.py), found as transformers finds them when it loads the folder."""
    main = os.path.join(ROOT, "model", "model_minimind.py")
    return [main] + sorted(get_relative_import_files(main))


def export(args):
    """A .pth / resume checkpoint -> Qwen3(-MoE) or MiniMind-format folder; returns the verified logits diff."""
    model, config, tokenizer_dir, save_dtype = source_model(args)
    with files_replaced_in(args.out_dir) as folder:  # config.json last: a cut-off export never loads
        if args.format == "minimind":
            out_model = MiniMindForCausalLM(config)
            out_model.load_state_dict(model.state_dict())
            out_model.config.auto_map = {"AutoConfig": "model_minimind.MiniMindConfig",
                                         "AutoModelForCausalLM": "model_minimind.MiniMindForCausalLM"}
            save_quietly(out_model.to(save_dtype), folder)
            for path in remote_code_files():
                shutil.copy(path, folder)
        else:
            out_model = save_hf_folder(model.state_dict(), config, folder, save_dtype)
        copy_tokenizer(tokenizer_dir, folder)
    params = sum(p.numel() for p in out_model.parameters()) / 1e6
    print(f"wrote {type(out_model).__name__} ({params:.2f}M params, {save_dtype}) to {args.out_dir}")
    # in this process transformers 5 prefers our registered MiniMind class to the folder's copy of the same file;
    # tests/test_convert_model.py loads the folder's own code in a fresh interpreter
    diff = max_logit_diff(model, args.out_dir, config.vocab_size, trust_remote_code=args.format == "minimind")
    print(f"verify: max abs logits diff {diff:.3g} (folder via AutoModelForCausalLM vs source, fp32)")
    return diff


def export_gguf(args):
    """A .pth / resume checkpoint -> <out_dir>/minimind-<type>.gguf + Modelfile; returns the worst read-back error
    as a fraction of the type's rounding bound (<= 1: as written)."""
    model, config, tokenizer_dir, _ = source_model(args)
    name, earlier = gguf_name(args.gguf_type), modelfile_target(args.out_dir)
    with files_replaced_in(args.out_dir, last="Modelfile") as folder:  # Modelfile last: it names the new file
        write_gguf(model.state_dict(), config, tokenizer_dir, os.path.join(folder, name), args.gguf_type)
        atomic_write_text(os.path.join(folder, "Modelfile"), modelfile(name, config.max_position_embeddings))
    path = os.path.join(args.out_dir, name)
    print(f"wrote {path} ({'qwen3moe' if config.use_moe else 'qwen3'}, {args.gguf_type}, "
          f"{os.path.getsize(path) / 2**20:.1f} MiB) and its Ollama Modelfile; tokenizer from {tokenizer_dir}")
    if earlier and earlier != name and os.path.isfile(os.path.join(args.out_dir, earlier)):
        print(f"the Modelfile named {earlier} before; that file stays beside {name}")
    ratio = worst_rounding_ratio(path, model.state_dict(), config)
    print("verify: tensors read back exactly" if ratio == 0 else
          f"verify: tensors read back within {ratio:.3g}x their {args.gguf_type} rounding bound (<= 1 passes)")
    return ratio


def gguf_name(gguf_type):
    return f"minimind-{gguf_type}.gguf"


def merged_with_lora(model, config, args, save_dtype, tokenizer_dir):
    """The plain model with --lora folded in (W + B @ A, in save_dtype as it is written); the merged .pth is saved,
    its sidecar recording the tokenizer."""
    adapted = apply_lora_file(copy.deepcopy(model), args.lora)
    merged = merge_lora(copy.deepcopy(adapted)).to(save_dtype)
    save_weights_file(merged.state_dict(), config, args.merged_weight, {"tokenizer": tokenizer_record(tokenizer_dir)})
    merged = merged.float().eval()
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (merged(ids).logits - adapted.eval()(ids).logits).abs().max().item()
    print(f"merged {args.lora} into {args.weight}: wrote {args.merged_weight} ({save_dtype}); max abs logits diff "
          f"{diff:.3g} against base + adapter (fp32; rounding to {save_dtype} included)")
    return merged


def import_folder(args):
    """A Qwen3(-MoE) / MiniMind-format folder -> MiniMind .pth; returns the verified logits diff (None if skipped)."""
    state_dict, fields = read_weights(args.out_dir)
    config = MiniMindConfig(**fields)
    model = MiniMindForCausalLM(config).eval()
    mismatch = shape_mismatch(state_dict, model, args.out_dir)
    if mismatch:
        raise mismatch
    state_dict = clean_state_dict(state_dict, True)
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    os.makedirs(os.path.dirname(args.weight) or ".", exist_ok=True)
    save_weights_file({k: v.contiguous() for k, v in state_dict.items()}, config, args.weight,
                      read_record(args.out_dir))  # the folder's own tokenizer, where it has one
    flags = " ".join(f"--{k} {int(v) if isinstance(v, bool) else v}" for k, v in fields.items()
                     if k in SHAPE_FLAGS + HIDDEN_FLAGS + ("use_moe",))
    print(f"wrote MiniMind weights to {args.weight}, its config to {sidecar_path(args.weight)} (flags: {flags})")
    with open(os.path.join(args.out_dir, "config.json")) as f:
        native = json.load(f).get("model_type") != "minimind"
    if not (native or args.trust_remote_code):
        print("verify: skipped (a minimind folder runs its own code: pass --trust_remote_code 1 to compare)")
        return None
    diff = max_logit_diff(model, args.out_dir, config.vocab_size, trust_remote_code=not native)
    print(f"verify: max abs logits diff {diff:.3g} (our model vs the folder via AutoModelForCausalLM, fp32)")
    return diff


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Convert MiniMind weights <-> Hugging Face folders")
    parser.add_argument("--to", choices=["hf", "minimind", "gguf"], default="hf",
                        help="hf: export weights to a folder; minimind: import a folder to a .pth; gguf: export a "
                             "GGUF + Ollama Modelfile into --out_dir")
    parser.add_argument("--gguf_type", choices=OUT_TYPES, default="f16", help="--to gguf: the tensors' type")
    parser.add_argument("--format", choices=["qwen3", "minimind"], default="qwen3",
                        help="export format: Qwen3 / Qwen3-MoE, or MiniMind's (trust_remote_code)")
    parser.add_argument("--weight", default=None,
                        help="MiniMind .pth (its <name>.json config beside it is read / written) or resume checkpoint "
                             "(export input / import output); default out/pretrain_768.pth")
    parser.add_argument("--out_dir", "--hf_dir", dest="out_dir", default=None,
                        help="Hugging Face folder (export output / import input); default out/hf_model")
    parser.add_argument("--tokenizer_path", default=None,
                        help="default: the tokenizer the weights record (their sidecar or checkpoint), else model/")
    parser.add_argument("--force_tokenizer", type=int, default=0, choices=[0, 1],
                        help="1: copy --tokenizer_path even where it is not the tokenizer the weights record")
    parser.add_argument("--lora", default=None, help="export: merge this LoRA adapter (MiniMind's .pth) first")
    parser.add_argument("--merged_weight", default=None,
                        help="with --lora: the merged .pth (default: merge_<adapter name>.pth beside --weight)")
    parser.add_argument("--overwrite", type=int, default=0, choices=[0, 1],
                        help="1: replace an earlier export at --out_dir (--to minimind: the .pth at --weight) and "
                             "the merged .pth at --merged_weight")
    parser.add_argument("--trust_remote_code", type=int, default=0, choices=[0, 1],
                        help="import: run a minimind folder's own code to compare logits")
    for name in SHAPE_FLAGS + ("num_experts_per_tok",):  # must agree with the weights; only for a .pth without .json
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--use_moe", type=int, default=None, choices=[0, 1])
    parser.add_argument("--rope_theta", type=float, default=None)
    args = parser.parse_args(argv)
    # typed paths resolve against the current directory, defaults against the repository root
    args.weight = os.path.abspath(args.weight) if args.weight else os.path.join(ROOT, "out", "pretrain_768.pth")
    default_dir = os.path.join(ROOT, "out", "gguf" if args.to == "gguf" else "hf_model")
    args.out_dir = os.path.abspath(args.out_dir) if args.out_dir else default_dir
    if args.lora:
        args.lora = os.path.abspath(args.lora)
        name = os.path.splitext(os.path.basename(args.lora))[0].removeprefix("lora_")
        args.merged_weight = os.path.abspath(args.merged_weight) if args.merged_weight else os.path.join(
            os.path.dirname(args.weight), f"merge_{name}.pth")
    return args


def earlier_export(args):
    """(flag, the file that marks an export already at that flag's output: a folder's config.json, a GGUF of the same
    type, an imported .pth, a merged .pth at --merged_weight), or None: as a training run, an export does not replace
    another unasked (a GGUF of another type stays beside it; the Modelfile then names the new one, and says so)."""
    if args.to == "minimind":
        return ("--weight", args.weight) if os.path.isfile(args.weight) else None
    names = sorted(os.listdir(args.out_dir)) if os.path.isdir(args.out_dir) else []
    marks = [n for n in names if n == ("config.json" if args.to == "hf" else gguf_name(args.gguf_type))]
    if marks:
        return "--out_dir", os.path.join(args.out_dir, marks[0])
    return ("--merged_weight", args.merged_weight) if args.lora and os.path.isfile(args.merged_weight) else None


def check_args(args):
    """Flags in range, the input present, the output writable, before anything is read or written."""
    for name in SHAPE_FLAGS + ("num_experts_per_tok",):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {value})")
    if args.rope_theta is not None and not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
        raise ConfigError(f"--rope_theta must be a positive number (got {args.rope_theta})")
    if args.to == "minimind":
        if not os.path.isfile(os.path.join(args.out_dir, "config.json")):
            raise ConfigError(f"--out_dir {args.out_dir} has no config.json; --to minimind imports a Hugging Face "
                              "model folder given with --out_dir (--hf_dir)")
        if os.path.isdir(args.weight) or not args.weight.endswith(".pth"):
            raise ConfigError(f"--weight {args.weight}: --to minimind writes a .pth file; pass a path ending in .pth")
        check_writable(os.path.dirname(args.weight), "--weight folder")
    else:
        check_writable(args.out_dir, "--out_dir")
    held = earlier_export(args)
    if held and not args.overwrite:
        flag, mark = held
        raise ConfigError(f"{flag} {getattr(args, flag[2:])} holds an earlier export ({os.path.basename(mark)}); "
                          f"--overwrite 1 replaces it, or choose another {flag}")
    if args.lora and (args.to == "minimind" or not os.path.isfile(args.lora)):
        raise ConfigError(f"--lora {args.lora} is not a file" if args.to != "minimind" else
                          "--lora merges an adapter on export (--to hf); import the folder without it")
    if args.lora:
        check_writable(os.path.dirname(args.merged_weight), "--merged_weight folder")


def main(argv=None):
    """Run the conversion; returns the exit code (2: bad input, 1: exported logits or GGUF tensors differ, 3: a full
    disk or no gguf package, 0: ok)."""
    args = parse_args(argv)
    try:
        check_args(args)
        if args.use_moe is not None:
            args.use_moe = bool(args.use_moe)
        if args.to == "gguf":
            ratio = export_gguf(args)
            if not ratio <= 1:  # NaN fails too
                print(f"error: a tensor read back from the GGUF is {ratio:.3g} times its {args.gguf_type} rounding "
                      "bound away from the source; the GGUF is wrong", file=sys.stderr)
                return 1
            return 0
        diff = export(args) if args.to == "hf" else import_folder(args)
    except (ConfigError, WeightsError, LoraError, TokenizerMismatch) as e:
        print(f"error: {weights_line(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name != "gguf":
            raise
        print("error: --to gguf needs the gguf package (llama.cpp's writer): pip install -r requirements.txt",
              file=sys.stderr)
        return 3
    except Exception as e:  # a full disk: an OSError, or safetensors' SafetensorError
        reason = full_disk_reason(e)
        if reason is None:
            raise
        flag = "--weight" if args.to == "minimind" else "--out_dir"
        target = getattr(args, flag[2:]) + (f" and {args.merged_weight}" if args.lora else "")  # the merged .pth first
        print(f"error: disk full writing {target} ({reason}); what was there is as it was; free space or choose "
              f"another {flag}, then run again", file=sys.stderr)
        return 3
    if diff is not None and not diff <= MAX_LOGIT_DIFF:  # NaN logits fail too
        print(f"error: logits differ by {diff:.3g} > {MAX_LOGIT_DIFF:g}; the converted folder is wrong",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
