"""model/export/gguf.py: GGUF exports load in stock llama.cpp (llama-cpp-python) and in transformers' GGUF loader with
our logits, greedy tokens, tokenization and chat template; every tensor reads back within its type's rounding bound."""
import copy
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.export.gguf import GPT2_REGEX, QWEN2_REGEX, pre_tokenizer_name, read_gguf, worst_rounding_ratio, write_gguf
from model.provenance import tokenizer_record
from model.weights.files import save_weights_file
from model.weights.shapes import WeightsError
from scripts.convert_model import main as convert_main
from tests.helpers.launch import ROOT
from tests.helpers.weight_files import source_model, tiny

try:  # optional: pip builds llama.cpp from source for it (requirements-llama.txt)
    import llama_cpp
except ImportError:
    llama_cpp = None

needs_llama = pytest.mark.skipif(llama_cpp is None, reason="llama_cpp is not importable: pip install -r "
                                 "requirements-llama.txt (builds llama.cpp from source, several minutes)")
MODEL_DIR = os.path.join(ROOT, "model")
U32 = 2.0 ** -24  # float32 unit roundoff
TEXTS = ["12345 678901 3.14159 2024-11-26", "a  b   c\n\n\td\t\t e    \n", "你好，世界！机器学习很有趣。",
         "emoji 🙂👍🏽 🇨🇳 flags", "  leading and trailing  ", "don't I'll we're THEY'VE", "",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
         '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|endoftext|>']


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """export(use_moe, gguf_type) -> (source model, GGUF path), written by the CLI once per module."""
    done = {}

    def make(use_moe, gguf_type):
        if (use_moe, gguf_type) not in done:
            folder = tmp_path_factory.mktemp(f"gguf_{int(use_moe)}_{gguf_type}")
            model = source_model(tiny(use_moe=use_moe, num_experts_per_tok=2))
            weight = folder / "tiny.pth"
            save_weights_file(model.state_dict(), model.config, str(weight),
                              {"tokenizer": tokenizer_record(MODEL_DIR)})
            args = ["--to", "gguf", "--weight", str(weight), "--out_dir", str(folder / "out"), "--gguf_type", gguf_type]
            assert convert_main(args) == 0
            done[use_moe, gguf_type] = model, folder / "out" / f"minimind-{gguf_type}.gguf"
        return done[use_moe, gguf_type]
    return make


def load_llama(path, **kw):
    # f32 K/V cache: llama.cpp's default f16 cache would round K and V to 11 bits
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, n_batch=128, logits_all=True, verbose=False,
                           type_k=0, type_v=0, seed=0, **kw)


def error_terms(model64, ids):
    """(chain, inner, scale, float64 logits) of a first-order error bound chain * per-matmul relative error * scale:
    each matmul errs by at most (relative error) * |A||B|, those errors add along the matmuls a token's logits pass
    through (per layer: q/k/v, scores, weights@v, o, gate/up, down; then the head: `chain`), RMSNorm rescales them
    without first-order growth, and |A||B| is taken at the head, |h| @ |W_head|, computed in float64 (`scale`);
    `inner` is the largest inner dimension (float32: relative error K * u, Higham's gamma_K)."""
    config = model64.config
    hidden = {}
    handle = model64.model.norm.register_forward_hook(lambda m, i, out: hidden.update(h=out))
    with torch.no_grad():
        logits = model64(ids).logits
        scale = (hidden["h"].abs() @ model64.lm_head.weight.abs().T).max().item()
    handle.remove()
    inner = max(config.hidden_size, config.intermediate_size, config.moe_intermediate_size,
                config.num_attention_heads * config.head_dim, ids.shape[1])
    return 6 * config.num_hidden_layers + 1, inner, scale, logits


def f32_bound(model64, ids):
    chain, inner, scale, logits = error_terms(model64, ids)
    return chain * inner * U32 * scale, logits


def test_pre_tokenizer_is_named_by_its_regex():
    with open(os.path.join(MODEL_DIR, "tokenizer.json"), encoding="utf-8") as f:
        ours = json.load(f)
    assert ours["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True}
    assert pre_tokenizer_name(ours) == "gpt-2"  # llama.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2, which runs GPT-2's regex
    split = {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False}
    qwen2 = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}
    assert pre_tokenizer_name(qwen2) == "qwen2"
    other = {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": GPT2_REGEX + "|x"}}}
    with pytest.raises(WeightsError, match="matches none of llama.cpp's"):
        pre_tokenizer_name(other)


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("use_moe", [False, True])
def test_tensors_read_back_within_their_rounding_bound(tmp_path, use_moe, gguf_type):
    model = source_model(tiny(use_moe=use_moe, num_experts_per_tok=2))
    path = str(tmp_path / "m.gguf")
    write_gguf(model.state_dict(), model.config, MODEL_DIR, path, gguf_type)
    assert worst_rounding_ratio(path, model.state_dict(), model.config) <= 1  # f32: exactly
    state_dict, fields = read_gguf(path)
    arch = "qwen3moe" if use_moe else "qwen3"
    assert fields["general.architecture"] == arch and fields[f"{arch}.attention.key_length"] == 16
    assert set(state_dict) == set(model.state_dict())


@pytest.mark.parametrize("use_moe", [False, True])
def test_transformers_gguf_loader_gives_our_logits(tmp_path, use_moe):
    """transformers' GGUF mapping (integrations/ggml.py) reads no key_length for qwen3 and no expert feed-forward
    length for qwen3moe, so it builds Qwen3's defaults (head_dim 128, moe_intermediate_size 768): shapes it supports."""
    config = tiny(use_moe=True, num_experts_per_tok=2, moe_intermediate_size=768) if use_moe else tiny(head_dim=128)
    model = source_model(config)
    write_gguf(model.state_dict(), config, MODEL_DIR, str(tmp_path / "m.gguf"), "f32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    if use_moe and not loaded.config.norm_topk_prob:
        # GGUF has no such key (llama.cpp's qwen3moe always renormalises the top-k weights); transformers < 5's GGUF
        # mapping leaves Qwen3MoeConfig's default False, 5.x sets True: the weights are what this test checks
        for layer in loaded.model.layers:
            layer.mlp.norm_topk_prob = True
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    bound, reference = f32_bound(copy.deepcopy(model).double(), ids)
    with torch.no_grad():
        assert (loaded(ids).logits.double() - reference).abs().max().item() <= bound


@needs_llama
def test_llama_cpp_tokenizes_and_detokenizes_as_ours(export):
    _, path = export(False, "f32")
    llm = load_llama(path, vocab_only=True)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids, text
        assert llm.detokenize(ids, special=True).decode() == tokenizer.decode(ids) == text


@needs_llama
@pytest.mark.parametrize("use_moe", [False, True])
def test_llama_cpp_f32_logits_and_greedy_tokens_match_ours(export, use_moe):
    model, path = export(use_moe, "f32")
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompt = tokenizer.encode("<|im_start|>user\n1 + 1 = ?<|im_end|>\n<|im_start|>assistant\n")
    llm = load_llama(path)
    llama_tokens = [t for t, _ in zip(llm.generate(prompt, temp=0.0, top_k=1, reset=True), range(12))]
    ours = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ours.append(int(model(torch.tensor([ours])).logits[0, -1].argmax()))
    model64, ids = copy.deepcopy(model).double(), torch.tensor([ours])
    bound, reference = f32_bound(model64, ids)
    reference = reference[0]
    top2 = reference[len(prompt) - 1:-1].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 2 * bound  # no near-tie: greedy is decided at this precision
    assert llama_tokens == ours[len(prompt):]
    llm.reset()
    llm.eval(ours)
    llama_logits = torch.from_numpy(np.array(llm.scores[:len(ours)], dtype=np.float64))
    assert (llama_logits - reference).abs().max().item() <= bound
    with torch.no_grad():
        assert (model(ids).logits[0].double() - reference).abs().max().item() <= bound


@needs_llama
@pytest.mark.parametrize("use_moe", [False, True])
def test_llama_cpp_q8_0_logits_within_the_quantization_bound(export, use_moe):
    """q8_0 rounds each weight by at most half a step (block max / 127, the step itself rounded to f16) and llama.cpp
    rounds activations to q8_0 the same way before each matmul: to first order each matmul errs relatively by the sum,
    and those add along the chain as in f32_bound. (The MoE router stays f32: rounded, it flips near-tied experts,
    a jump no rounding bound covers.)"""
    model, path = export(use_moe, "q8_0")
    ids = AutoTokenizer.from_pretrained(MODEL_DIR).encode("The quick brown fox jumps over the lazy dog 12345")
    llm = load_llama(path)
    llm.eval(ids)
    llama_logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64))
    chain, inner, scale, reference = error_terms(copy.deepcopy(model).double(), torch.tensor([ids]))
    step = (0.5 + 127 * 2.0 ** -11) / 127  # half a q8_0 step relative to the block's largest value
    bound = chain * (2 * step + inner * U32) * scale  # weights and activations rounded, then f32 arithmetic
    assert (llama_logits - reference[0]).abs().max().item() <= bound


@needs_llama
def test_chat_template_in_the_gguf_renders_as_ours(export):
    _, path = export(False, "f32")
    llm = load_llama(path, vocab_only=True)
    template = llm.metadata["tokenizer.chat_template"]
    messages = [{"role": "system", "content": "You are MiniMind."}, {"role": "user", "content": "gcd of 12 and 18?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                 "tool_calls": [{"type": "function", "function": {"name": "gcd", "arguments": '{"a": 12, "b": 18}'}}]},
                {"role": "tool", "content": "6"}, {"role": "assistant", "content": "It is 6."},
                {"role": "user", "content": "Thanks! 谢谢"}]
    formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter(template=template, eos_token="<|im_end|>",
                                                                 bos_token="<|im_start|>")
    ours = AutoTokenizer.from_pretrained(MODEL_DIR).apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert formatter(messages=messages).prompt == ours
