"""YaRN (MiniMind-3's inference_rope_scaling): our RoPE frequencies equal MiniMind's precompute_freqs_cis (written below
in float64) and transformers' Qwen3 with rope_type yarn; MiniMind-3's config files load; an export writes the scaling
into config.json; eval_llm.py --inference_rope_scaling 1 generates with it."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from model.hf_convert import hf_to_minimind, minimind_to_hf, read_hf_folder, save_hf_folder
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, RotaryEmbedding
from model.weights.shapes import WeightsError, config_fields
from model.yarn import YARN_ROPE_SCALING
from scripts.eval_llm import main as eval_main
from scripts.eval_llm import parse_args
from scripts.inference.load import load_chat_model
from tests.helpers.launch import ROOT
from tests.helpers.serving import greedy_continuation

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
TINY = dict(vocab_size=6400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def minimind_freqs_float64(dim, end, rope_base, rope_scaling, positions):
    """MiniMind's precompute_freqs_cis (jingyaogong/minimind model/model_minimind.py), every step in float64."""
    freqs = 1.0 / (rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    attn_factor = 1.0
    if rope_scaling is not None:
        orig_max, factor = rope_scaling["original_max_position_embeddings"], rope_scaling["factor"]
        beta_fast, beta_slow = rope_scaling["beta_fast"], rope_scaling["beta_slow"]
        attn_factor = rope_scaling["attention_factor"]
        if end / orig_max > 1.0:
            def inv_dim(b):
                return (dim * math.log(orig_max / (b * 2 * math.pi))) / (2 * math.log(rope_base))
            low, high = max(math.floor(inv_dim(beta_fast)), 0), min(math.ceil(inv_dim(beta_slow)), dim // 2 - 1)
            ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001), 0, 1)
            freqs = freqs * (1 - ramp + ramp / factor)
    angles = torch.outer(positions.double(), freqs)
    return (torch.cat([angles.cos(), angles.cos()], -1) * attn_factor,
            torch.cat([angles.sin(), angles.sin()], -1) * attn_factor)


@pytest.mark.parametrize("head_dim", [96, 16])
def test_rope_frequencies_equal_minimind_formula_in_float64(head_dim):
    config = MiniMindConfig(head_dim=head_dim, inference_rope_scaling=True)
    positions = torch.arange(0, 8192, 7)
    cos, sin = RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    ref_cos, ref_sin = minimind_freqs_float64(head_dim, config.max_position_embeddings, config.rope_theta,
                                              YARN_ROPE_SCALING, positions)
    # fp32 angle = position * inv_freq, each rounded (2^-24 relative) twice: |d cos|, |d sin| <= |d angle|
    bound = float(positions.max()) * 2 ** -22 + 1e-6
    assert (cos[0].double() - ref_cos).abs().max() < bound and (sin[0].double() - ref_sin).abs().max() < bound
    plain_cos, _ = minimind_freqs_float64(head_dim, config.max_position_embeddings, config.rope_theta, None, positions)
    assert (plain_cos - ref_cos).abs().max() > 0.5  # YaRN moved the low frequencies: the check above has teeth


def tiny_yarn_model(seed=0):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig(inference_rope_scaling=True, **TINY)).eval()


def test_logits_equal_transformers_qwen3_with_yarn():
    model = tiny_yarn_model()
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    written = hf_config.to_dict()
    assert (written.get("rope_parameters") or written["rope_scaling"])["rope_type"] == "yarn"  # 5.x / 4.x key
    hf = Qwen3ForCausalLM(hf_config).eval()
    hf.load_state_dict(hf_sd, strict=False)
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3000, 3024)[None].expand(2, -1)  # far out, where YaRN's long wavelengths matter
    plain = MiniMindForCausalLM(MiniMindConfig(**TINY)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, ref = model(ids, position_ids=positions).logits, hf(ids, position_ids=positions).logits
        assert (ours - ref).abs().max().item() < 1e-4
        assert (plain(ids, position_ids=positions).logits - ours).abs().max().item() > 1e-3
    config, state_dict = hf_to_minimind(hf_sd, hf_config)  # and back: the scaling survives the round trip
    assert config.inference_rope_scaling and config.rope_theta == model.config.rope_theta


def test_other_rope_scaling_is_refused():
    model = tiny_yarn_model()
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    key = "rope_parameters" if hasattr(hf_config, "rope_parameters") else "rope_scaling"  # transformers 5.x / 4.x
    setattr(hf_config, key, dict(getattr(hf_config, key), factor=4.0))
    with pytest.raises(WeightsError, match="MiniMind-3's YaRN"):
        hf_to_minimind(hf_sd, hf_config)


@pytest.mark.parametrize("fixture", ["minimind3_config.json", "minimind3_config_transformers5.json"])
def test_minimind3_config_with_yarn_loads(tmp_path, fixture):
    """MiniMind-3's config.json (inference_rope_scaling true) reads as our config; a folder with it loads and gives
    the logits of our YaRN model."""
    with open(os.path.join(FIXTURES, fixture)) as f:
        raw = json.load(f)
    full = MiniMindConfig(**config_fields(raw))
    assert full.inference_rope_scaling and full.hidden_size == 768 and full.num_hidden_layers == 8
    model = tiny_yarn_model()
    folder = tmp_path / "minimind-3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(raw, **TINY)))  # same file, the tiny shape
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    state_dict, fields = read_hf_folder(str(folder))
    assert fields["inference_rope_scaling"] is True and fields["rope_theta"] == 1e6
    loaded = MiniMindForCausalLM(MiniMindConfig(**fields)).eval()
    loaded.load_state_dict(state_dict)
    ids = torch.randint(0, 6400, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_export_writes_rope_scaling_that_transformers_reads(tmp_path):
    model = tiny_yarn_model()
    save_hf_folder(model.state_dict(), model.config, str(tmp_path / "hf"), torch.float32)
    with open(tmp_path / "hf" / "config.json") as f:
        written = json.load(f)
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
        assert written["rope_scaling"][key] == YARN_ROPE_SCALING[key] == written["rope_parameters"][key]
    assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] == "yarn"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 6400, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_eval_llm_inference_rope_scaling_generates_with_yarn(tmp_path, capsys):
    torch.manual_seed(0)
    plain = MiniMindForCausalLM(MiniMindConfig(**TINY)).eval()
    torch.save(plain.state_dict(), tmp_path / "pretrain_64.pth")
    yarn = MiniMindForCausalLM(MiniMindConfig(inference_rope_scaling=True, **TINY)).eval()
    yarn.load_state_dict(plain.state_dict())
    argv = ["--save_dir", str(tmp_path), "--weight", "pretrain", "--hidden_size", "64", "--num_hidden_layers", "2",
            "--num_attention_heads", "4", "--num_key_value_heads", "2", "--device", "cpu"]
    loaded, tokenizer = load_chat_model(parse_args(argv + ["--inference_rope_scaling", "1"]))
    assert load_chat_model(parse_args(argv + ["--inference_rope_scaling"]))[0].config.inference_rope_scaling
    ids = torch.randint(0, 6400, (1, 300), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, yarn(ids).logits)
        assert (loaded(ids).logits - plain(ids).logits).abs().max().item() > 1e-3
    prompt = "The Python interpreter"
    eval_main(argv + ["--prompt", prompt, "--temperature", "0", "--max_new_tokens", "12", "--inference_rope_scaling",
                      "1"])
    assert greedy_continuation(yarn, tokenizer, prompt, 12) in capsys.readouterr().out
