"""trainer/rl/packed_weights.py: decoding's linears on weights packed once (oneDNN) compute the model's products
(against float64 written out here), keep LoRA's hooks, leave other forwards alone and are undone on exit."""
import copy

import pytest
import torch
from torch import nn

from model.lora import apply_lora
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.torch_compat import cpu_bf16_native
from trainer.rl import packed_weights
from trainer.rl.packed_weights import packed_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
CONFIG = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def lora_model():
    """A tiny model with LoRA on the attention's q and v (B non-zero, so the hooks change the output)."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(CONFIG).eval()
    apply_lora(model, rank=4, targets=("q_proj", "v_proj"))
    for name, p in model.named_parameters():
        if name.endswith("B.weight"):
            nn.init.normal_(p, std=0.05)
    return model


def test_packed_linears_compute_the_model_within_fp32_rounding_and_are_undone_on_exit(monkeypatch):
    """Inside (every weight packed, whatever its size): every Linear (7 per layer, the lm_head, LoRA's A and B on 2
    projections per layer) runs packed, and the logits of a decode-shaped batch are the float64 model's within fp32
    rounding (logits of size ~3 through 2 layers: 1e-5), as the plain fp32 forward's are; outside: no Linear keeps a
    forward of its own and the output is the plain forward's, bit for bit."""
    monkeypatch.setattr(packed_weights, "PACK_MIN_ELEMENTS", {torch.float32: 0, torch.bfloat16: 0})
    model = lora_model()
    ids = torch.randint(3, CONFIG.vocab_size, (3, 1), generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(model).double()(ids).logits
    plain = model(ids).logits
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert len(linears) == 2 * 7 + 1 + 2 * 2 * 2
    with torch.no_grad(), packed_linears(model, rows=3) as count:
        packed = model(ids).logits
        assert count == len(linears) and all("forward" in m.__dict__ for m in linears)
    assert (plain.double() - exact).abs().max().item() < 1e-5
    assert (packed.double() - exact).abs().max().item() < 1e-5
    assert not any("forward" in m.__dict__ for m in linears)
    assert torch.equal(model(ids).logits, plain)


def test_only_weights_worth_a_reorder_are_packed():
    """By default fp32 packs only weights of PACK_MIN_ELEMENTS or more: of the tiny model's, the lm_head (6400 x 64);
    at hidden 256 the MLP's three (832 x 256) and the lm_head, not the attention's (256 x 256 and smaller)."""
    for hidden, expected in ((64, 1), (256, 2 * 3 + 1)):
        config = MiniMindConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = MiniMindForCausalLM(config).eval()
        with torch.no_grad(), packed_linears(model, rows=8) as count:
            assert count == expected
            layer = model.model.layers[0]
            assert "forward" in model.lm_head.__dict__ and "forward" not in layer.self_attn.q_proj.__dict__
            assert ("forward" in layer.mlp.up_proj.__dict__) == (hidden == 256)


def test_a_forward_patched_by_someone_else_is_kept(monkeypatch):
    """A Linear whose forward was replaced on the instance is not packed, and keeps that forward inside and after."""
    monkeypatch.setattr(packed_weights, "PACK_MIN_ELEMENTS", {torch.float32: 0, torch.bfloat16: 0})
    model = MiniMindForCausalLM(CONFIG).eval()
    doubled = model.lm_head.forward

    def forward(x):
        return 2 * doubled(x)
    model.lm_head.forward = forward
    ids = torch.tensor([[5, 7]])
    with torch.no_grad(), packed_linears(model, rows=1) as count:
        assert count == 2 * 7 and model.lm_head.forward is forward
        inside = model(ids).logits
    assert model.lm_head.forward is forward
    with torch.no_grad():
        assert torch.allclose(inside, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.skipif(not cpu_bf16_native(), reason="no native bf16 on this CPU: bf16 autocast is refused on it")
def test_under_bf16_autocast_a_packed_linear_gives_the_bf16_product_rounded_once(monkeypatch):
    """bf16 autocast: the input and weight rounded to bf16, their exact product (float64 here) rounded once to bf16:
    half an ulp (2^-8 relative at most) plus fp32's sums over 64 terms; the result in bf16, as autocast's F.linear
    gives."""
    monkeypatch.setattr(packed_weights, "PACK_MIN_ELEMENTS", {torch.float32: 0, torch.bfloat16: 0})
    g = torch.Generator().manual_seed(3)
    layer = nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 64, generator=g)
    exact = x.bfloat16().double() @ layer.weight.bfloat16().double().T + layer.bias.bfloat16().double()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(layer, rows=5) as count:
        out = layer(x)
    assert count == 1 and out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()
