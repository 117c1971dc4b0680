"""MiniMind <-> GGUF (llama.cpp's file format): the writer (write_gguf) and the reader (read_gguf), through the `gguf`
package llama.cpp publishes. Dense models map to llama.cpp's `qwen3` architecture, MoE to `qwen3moe`; the tokenizer
is written so that stock llama.cpp loads it: its pre-tokenizer named by the regex our tokenizer.json splits with.
"""
import errno
import json
import os

import numpy as np
import torch

from model.weights.shapes import WeightsError, clean_state_dict

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp's pre-tokenizer names (src/llama-vocab.cpp) by the split regex they run, as tokenizer.json writes it
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {GPT2_REGEX: "gpt-2", QWEN2_REGEX: "qwen2", LLAMA3_REGEX: "llama-bpe"}
# one name per MiniMind tensor inside a layer (experts are stacked into one 3-D tensor per projection)
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_refusal(config):
    """One line saying what llama.cpp's qwen3 / qwen3moe cannot hold of this config, or None."""
    if config.use_moe and config.n_shared_experts > 0:
        return (f"n_shared_experts={config.n_shared_experts}: llama.cpp's qwen3moe has no shared experts; "
                "only a model whose config.json has n_shared_experts 0 (the trainers' MoE) exports to GGUF; export "
                "this one to a Hugging Face folder (--to hf --format minimind)")
    if config.use_moe and not config.norm_topk_prob:
        return ("norm_topk_prob=False: llama.cpp's qwen3moe always renormalizes the top-k router weights; only a "
                "model trained with norm_topk_prob=True exports to GGUF")
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}: llama.cpp's qwen3 runs SiLU (SwiGLU) only"
    if getattr(config, "inference_rope_scaling", False):
        return ("inference_rope_scaling (YaRN) is not written to GGUF here; export a Hugging Face folder (--to hf) "
                "or the weights without YaRN")
    return None


def pre_tokenizer_name(tokenizer_json):
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json dict; WeightsError if llama.cpp has none."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regex = None
    for step in steps:
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            if step.get("add_prefix_space"):
                raise WeightsError("the tokenizer's ByteLevel add_prefix_space=true has no llama.cpp equivalent")
            regex = GPT2_REGEX  # the ByteLevel pre-tokenizer's own regex (tokenizers' byte_level.rs)
        elif step.get("type") == "Split":
            regex = step["pattern"].get("Regex")
    if regex not in PRE_TOKENIZERS:
        raise WeightsError(f"the tokenizer's pre-tokenizer (regex {regex!r}) matches none of llama.cpp's "
                           f"({', '.join(PRE_TOKENIZERS.values())}); stock llama.cpp would split text differently")
    return PRE_TOKENIZERS[regex]


def gguf_tensors(state_dict, config):
    """GGUF name -> float32 numpy array of a MiniMind state dict (experts stacked as [expert, out, in])."""
    state_dict = clean_state_dict(state_dict, config.tie_word_embeddings)
    out = {}
    for name, value in state_dict.items():
        array = value.detach().float().cpu().numpy()
        if name in TOP_NAMES:
            if not (name == "lm_head.weight" and config.tie_word_embeddings):  # tied: llama.cpp reuses token_embd
                out[TOP_NAMES[name]] = array
            continue
        parts = name.split(".")  # model.layers.<i>.<module...>.weight
        layer, module = parts[2], ".".join(parts[3:-1])
        if ".experts." in name:
            continue  # stacked below
        if module not in LAYER_NAMES:
            raise WeightsError(f"{name}: no GGUF tensor for this MiniMind weight")
        out[f"blk.{layer}.{LAYER_NAMES[module]}.weight"] = array
    if config.use_moe:
        for i in range(config.num_hidden_layers):
            for proj, gguf_name in EXPERT_NAMES.items():
                out[f"blk.{i}.{gguf_name}.weight"] = np.stack([
                    state_dict[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"].float().cpu().numpy()
                    for e in range(config.num_experts)])
    return out


def stored(name, array, out_type):
    """(data, raw type) of one tensor in `out_type`: norms and the MoE router stay f32 (as llama.cpp's converter
    keeps them: a rounded router flips near-tied expert choices), q8_0 falls back to f16 where a row is not a whole
    number of 32-value blocks."""
    from gguf import GGMLQuantizationType, quants  # optional dependency (requirements.txt)
    qtype = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16,
             "q8_0": GGMLQuantizationType.Q8_0}[out_type]
    if array.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        qtype = GGMLQuantizationType.F32
    elif qtype == GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
        qtype = GGMLQuantizationType.F16
    return quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), qtype


def add_model_fields(writer, config, out_type):
    from gguf import LlamaFileType
    writer.add_name("MiniMind")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.use_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    file_types = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
                  "q8_0": LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[out_type])


def add_tokenizer(writer, tokenizer_dir, vocab_size):
    """Tokens, their types, merges, special ids and the chat template, as llama.cpp's convert_hf_to_gguf.py writes a
    byte-level BPE tokenizer; ids past the tokenizer's vocabulary (a padded embedding) become unused tokens."""
    from gguf import SpecialVocab, TokenType
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    if tokenizer_json["model"]["type"] != "BPE":
        raise WeightsError(f"{tokenizer_dir}: a {tokenizer_json['model']['type']} tokenizer; GGUF export writes BPE")
    vocab = dict(tokenizer_json["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer_json.get("added_tokens", [])}
    vocab.update({t["content"]: i for i, t in added.items()})
    by_id = {i: token for token, i in vocab.items()}
    if max(by_id) >= vocab_size:
        raise WeightsError(f"the tokenizer has id {max(by_id)} but the model only {vocab_size} embeddings")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            # special added tokens match only when parsing specials, as in llama.cpp; plain added ones always do
            types.append(TokenType.NORMAL if i not in added else
                         TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer_json))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer)  # merges, bos/eos/unk/pad ids, add_bos_token, tokenizer_config's chat_template


def write_gguf(state_dict, config, tokenizer_dir, path, out_type):
    """Write a MiniMind state dict + its tokenizer as one GGUF file at `path` (`out_type`: one of OUT_TYPES)."""
    from gguf import GGUFWriter  # optional dependency (requirements.txt)
    refusal = gguf_refusal(config)
    if refusal:
        raise WeightsError(refusal)
    writer = GGUFWriter(path, "qwen3moe" if config.use_moe else "qwen3")
    try:
        add_model_fields(writer, config, out_type)
        add_tokenizer(writer, tokenizer_dir, config.vocab_size)
        for name, array in gguf_tensors(state_dict, config).items():
            data, qtype = stored(name, array, out_type)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as e:
        if e.errno is None and "requested and" in str(e):  # numpy's tofile: a short write to a file is a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from e
        raise
    finally:
        writer.close()


def rounding_bound(array, qtype):
    """Elementwise bound on |stored - array| for a float32 `array` stored as `qtype`: half a unit in the last place
    (f16, bf16, plus their smallest subnormal step); q8_0: half a step d = block max / 127, d itself rounded to f16."""
    from gguf import GGMLQuantizationType as Q
    size = np.abs(array)
    if qtype == Q.F32:
        return np.zeros_like(size)
    if qtype == Q.F16:
        return size * 2.0 ** -11 + 2.0 ** -25
    if qtype == Q.BF16:
        return size * 2.0 ** -8 + 2.0 ** -133
    step = size.reshape(-1, 32).max(axis=1, keepdims=True) / 127
    bound = step * (0.5 + 127 * 2.0 ** -11) + 127 * 2.0 ** -25  # |q| <= 127 times f16(d)'s own rounding of d
    return (bound + size.reshape(-1, 32) * 2.0 ** -23).reshape(array.shape)


def read_gguf_tensors(path):
    """{GGUF tensor name: (float32 numpy array dequantized, stored type)} of a GGUF file."""
    from gguf import GGUFReader, quants  # optional dependency (requirements.txt)
    reader = GGUFReader(path)
    return {t.name: (np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32), t.tensor_type)
            for t in reader.tensors}


def worst_rounding_ratio(path, state_dict, config):
    """max |read back - source| / rounding_bound over every tensor of the GGUF at `path` (<= 1: as written;
    an f32 tensor must come back exactly)."""
    written = gguf_tensors(state_dict, config)
    stored_back = read_gguf_tensors(path)
    if set(written) != set(stored_back):
        raise WeightsError(f"{path} holds tensors {sorted(set(stored_back) ^ set(written))} it should (not) hold")
    worst = 0.0
    for name, source in written.items():
        back, qtype = stored_back[name]
        error, bound = np.abs(back.reshape(source.shape) - source), rounding_bound(source, qtype)
        exact = bound == 0
        if np.any(error[exact] > 0):
            return float("inf")
        if np.any(~exact):
            worst = max(worst, float(np.max(error[~exact] / bound[~exact])))
    return worst


def read_gguf(path):
    """(MiniMind state dict in float32, {GGUF key: value}) of a GGUF written by write_gguf, tensors dequantized."""
    from gguf import GGUFReader
    fields = {name: field.contents() for name, field in GGUFReader(path).fields.items()
              if not name.startswith("tokenizer.")}
    back = {v: k for k, v in TOP_NAMES.items()}
    back_layer = {v: k for k, v in LAYER_NAMES.items()}
    back_expert = {v: k for k, v in EXPERT_NAMES.items()}
    state_dict = {}
    for name, (array, _) in read_gguf_tensors(path).items():
        array = torch.from_numpy(array)
        if name in back:
            state_dict[back[name]] = array
            continue
        _, layer, kind, _ = name.split(".")
        if kind in back_expert:
            for e, expert in enumerate(array):
                state_dict[f"model.layers.{layer}.mlp.experts.{e}.{back_expert[kind]}.weight"] = expert
        else:
            state_dict[f"model.layers.{layer}.{back_layer[kind]}.weight"] = array
    if "lm_head.weight" not in state_dict:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    return state_dict, fields
