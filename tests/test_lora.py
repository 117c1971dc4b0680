"""model/lora.py: adapters add scale * x A^T B^T, save/load in MiniMind's format, export to PEFT, merge."""
import copy

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from transformers import __version__ as transformers_version

import trainer.parallel.tensor as tensor_parallel
from model.hf_convert import minimind_to_hf
from model.lora import (
    LoraError,
    apply_lora,
    apply_lora_file,
    load_lora,
    lora_modules,
    merge_lora,
    save_lora,
    save_peft,
)
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import spawn
from trainer.parallel.data import apply_data_parallel

VOCAB = 6400
TOL = 1e-4  # fp32: our model and transformers' differ only in summation order


def tiny(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                initializer_range=0.1, loss_chunk_size=0)
    return MiniMindConfig(**dict(base, **kw))


def model_of(config, seed=0):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config).eval()


def ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))


def logits(model):
    with torch.no_grad():
        return model(ids()).logits


def randomize(model, seed=1):
    """Non-zero A and B (B starts at zero, which would make every comparison trivial)."""
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora." in name:
            torch.nn.init.normal_(param, std=0.1)


def folded(config, adapted):
    """An independent plain model whose weights are W + scale * B @ A, computed here from the adapter tensors."""
    reference = model_of(config)
    state = reference.state_dict()
    for name, (_, lora) in lora_modules(adapted).items():
        state[f"{name}.weight"] = state[f"{name}.weight"] + lora.scale * lora.B.weight @ lora.A.weight
    reference.load_state_dict(state)
    return reference


def test_default_targets_are_minimind_square_layers_and_b_zero_is_the_base():
    config = tiny()  # q_proj 64x64 and o_proj 64x64 square; k/v 32x64 and the MLP are not
    base, model = model_of(config), model_of(config)
    names = apply_lora(model, rank=4)
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "o_proj")]
    assert torch.equal(logits(model), logits(base))


def test_hand_set_adapter_adds_scaled_low_rank_term():
    linear = torch.nn.Linear(6, 5, bias=False)
    holder = torch.nn.Module()
    holder.q_proj = linear
    apply_lora(holder, rank=2, alpha=3.0, targets=["q_proj"])
    a = torch.tensor([[1.0, 0, 2, 0, 0, -1], [0, 1, 0, 0, 3, 0]])
    b = torch.tensor([[1.0, 0], [0, 1], [2, 0], [0, -1], [1, 1]])
    with torch.no_grad():
        holder.lora.q_proj.A.weight.copy_(a)
        holder.lora.q_proj.B.weight.copy_(b)
    x = torch.randn(3, 6)
    expected = x @ linear.weight.T + 1.5 * x @ a.T @ b.T
    torch.testing.assert_close(linear(x), expected, rtol=1e-6, atol=1e-6)


def test_only_adapters_are_trainable():
    model = model_of(tiny())
    apply_lora(model, rank=4, targets=["q_proj", "v_proj", "down_proj"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"model.layers.{i}.{m}.{ab}.weight" for i in range(2) for ab in "AB"
                for m in ("self_attn.lora.q_proj", "self_attn.lora.v_proj", "mlp.lora.down_proj")}
    assert trainable == expected
    loss = model(ids(), labels=ids()).loss
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in expected)
    assert all(model.get_parameter(n).grad is not None for n in expected)


def test_minimind_format_round_trip(tmp_path):
    config = tiny()
    model = model_of(config)
    apply_lora(model, rank=4, alpha=8)
    randomize(model)
    path = tmp_path / "lora" / "identity_64.pth"
    save_lora(model, path)
    state = torch.load(path, weights_only=True)
    assert sorted(state) == sorted(f"model.layers.{i}.self_attn.{p}.lora.{ab}.weight"
                                   for i in range(2) for p in ("q_proj", "o_proj") for ab in "AB")
    # MiniMind adds B(A(x)) with no scaling: the file's B holds scale * B
    q_lora = model.model.layers[0].self_attn.lora.q_proj
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.lora.B.weight"], 2.0 * q_lora.B.weight)
    loaded = model_of(config)
    apply_lora(loaded, rank=4, alpha=8)
    load_lora(loaded, path)
    torch.testing.assert_close(logits(loaded), logits(folded(config, model)), rtol=0, atol=TOL)


def test_apply_lora_file_infers_rank_and_targets(tmp_path):
    config = tiny()
    model = model_of(config)
    apply_lora(model, rank=3, alpha=6, targets=["k_proj", "up_proj"])
    randomize(model)
    save_lora(model, tmp_path / "sft_64.pth")
    loaded = apply_lora_file(model_of(config), tmp_path / "sft_64.pth")
    assert sorted(lora_modules(loaded)) == sorted(lora_modules(model))
    torch.testing.assert_close(logits(loaded), logits(folded(config, model)), rtol=0, atol=TOL)
    torch.save({"model.embed_tokens.weight": torch.zeros(2)}, tmp_path / "base.pth")
    with pytest.raises(LoraError, match="holds no MiniMind LoRA keys"):
        apply_lora_file(model_of(config), tmp_path / "base.pth")


def test_load_refuses_adapter_of_other_targets(tmp_path):
    model = model_of(tiny())
    apply_lora(model, rank=4)
    save_lora(model, tmp_path / "a.pth")
    other = model_of(tiny())
    apply_lora(other, rank=4, targets=["v_proj"])
    with pytest.raises(LoraError, match="lacks model.layers.0.self_attn.v_proj.lora.A.weight"):
        load_lora(other, tmp_path / "a.pth")


def test_merge_equals_unmerged():
    config = tiny()
    model = model_of(config)
    apply_lora(model, rank=4, alpha=16, targets=["q_proj", "k_proj", "up_proj", "down_proj"])
    randomize(model)
    unmerged = logits(model)
    assert (unmerged - logits(model_of(config))).abs().max() > 100 * TOL
    merge_lora(model)
    assert not any(".lora." in k for k in model.state_dict())
    torch.testing.assert_close(logits(model), unmerged, rtol=0, atol=TOL)


def test_moe_expert_targets_match_hand_folded_weights():
    config = moe_config()
    model = model_of(config)
    names = apply_lora(model, rank=4, targets=["gate_proj", "up_proj", "down_proj"])
    assert len(names) == 2 * 4 * 3 and "model.layers.1.mlp.experts.3.down_proj" in names
    assert "model.layers.0.mlp.gate" not in names  # the router is never adapted
    randomize(model)
    assert (logits(model) - logits(model_of(config))).abs().max() > 100 * TOL  # the experts' adapters do act
    torch.testing.assert_close(logits(model), logits(folded(config, model)), rtol=0, atol=TOL)


def hf_export(model, config, tmp_path):
    """Our model's base weights as the Qwen3 folder scripts/convert_model.py writes (same mapping)."""
    base = {k: v for k, v in model.state_dict().items() if ".lora." not in k}
    hf_config, hf_sd = minimind_to_hf(base, config)
    hf_model = (Qwen3MoeForCausalLM if config.use_moe else Qwen3ForCausalLM)(hf_config)
    hf_model.load_state_dict(hf_sd, strict=True)
    hf_model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("targets", [None, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]])
def test_peft_loads_our_adapter_with_the_same_logits(tmp_path, targets):
    from peft import PeftModel
    config = tiny()
    model = model_of(config)
    apply_lora(model, rank=4, alpha=12, targets=targets)
    randomize(model)
    folder = hf_export(model, config, tmp_path)
    save_peft(model, tmp_path / "adapter")
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) >= {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}
    hf_model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids()).logits
    reference = logits(folded(config, model))
    torch.testing.assert_close(peft_logits, reference, rtol=0, atol=TOL)
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=TOL)


def moe_config():
    return tiny(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=0)


def test_peft_on_moe_attention_targets(tmp_path):
    from peft import PeftModel
    config = moe_config()
    model = model_of(config)
    apply_lora(model, rank=4, alpha=4, targets=["q_proj", "v_proj", "o_proj"])
    randomize(model)
    folder = hf_export(model, config, tmp_path)
    save_peft(model, tmp_path / "adapter")
    hf_model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids()).logits
    torch.testing.assert_close(peft_logits, logits(folded(config, model)), rtol=0, atol=TOL)


@pytest.mark.skipif(int(transformers_version.split(".")[0]) < 5, reason="transformers 4.x keeps experts as Linear")
def test_peft_refuses_fused_expert_targets(tmp_path):
    model = model_of(moe_config())
    apply_lora(model, rank=4, targets=["up_proj"])
    with pytest.raises(LoraError, match="model.layers.0.mlp.experts.0.up_proj has no nn.Linear"):
        save_peft(model, tmp_path / "adapter")


def test_bad_input_is_refused():
    model = model_of(tiny())
    with pytest.raises(LoraError, match="'qkv' is not one of"):
        apply_lora(model, targets=["qkv"])
    with pytest.raises(LoraError, match="call apply_lora"):
        merge_lora(model)
    with pytest.raises(LoraError, match="rank must be at least 1"):
        apply_lora(model, rank=0)
    with pytest.raises(LoraError, match="dropout must be in"):
        apply_lora(model, dropout=1.0)
    apply_lora(model, rank=4)
    with pytest.raises(LoraError, match="already has LoRA adapters"):
        apply_lora(model, rank=4, targets=["q_proj"])


def _compare_tp_lora(rank, world_size, config_kwargs, sequence_parallel):
    config = tiny(**config_kwargs)
    plain = model_of(config).train()
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    apply_lora(plain, rank=4, alpha=8, targets=targets)
    randomize(plain)
    model = copy.deepcopy(plain)  # frozen base: apply_tensor_parallel adds the adapters' plan and keeps it frozen
    tensor_parallel.apply_tensor_parallel(model, init_device_mesh("cpu", (world_size,)), sequence_parallel,
                                          loss_parallel=False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in plain.named_parameters() if p.requires_grad}
    attn = model.model.layers[0].self_attn.lora
    assert attn.q_proj.B.weight.placements == (Shard(0),) and attn.q_proj.A.weight.placements == (Replicate(),)
    assert attn.o_proj.A.weight.placements == (Shard(1),) and attn.o_proj.B.weight.placements == (Replicate(),)
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = plain(batch, labels=batch)
    ref.loss.backward()
    out = model(batch, labels=batch)
    out.loss.backward()
    where = f"(sp={sequence_parallel}, {config_kwargs})"
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5, msg=f"logits {where}")
    tp_params = dict(model.named_parameters())
    for name, param in plain.named_parameters():
        if param.requires_grad:
            grad = tp_params[name].grad
            assert isinstance(grad, DTensor) and grad.placements == tp_params[name].placements, name
            torch.testing.assert_close(grad.full_tensor(), param.grad, rtol=1e-4, atol=1e-6, msg=f"{name} {where}")


def _run_tp_cases(rank, world_size, cases):
    for config_kwargs, sequence_parallel in cases:
        _compare_tp_lora(rank, world_size, config_kwargs, sequence_parallel)


def test_tp2_adapters_match_single_process():
    moe = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=0)
    spawn(_run_tp_cases, 2, [({}, False), ({}, True), (moe, False)], timeout=240, start_method="fork")


def _compare_dp_lora(rank, world_size, zero_stage):
    plain = model_of(tiny()).train()
    apply_lora(plain, rank=4, alpha=8, targets=["q_proj", "o_proj", "gate_proj", "down_proj"])
    randomize(plain)
    model = apply_data_parallel(copy.deepcopy(plain), init_device_mesh("cpu", (world_size,)), zero_stage)
    batch = torch.randint(0, VOCAB, (2 * world_size, 16), generator=torch.Generator().manual_seed(3))
    plain(batch, labels=batch).loss.backward()  # the same number of target tokens on each rank: mean of means
    local = batch[rank * 2:(rank + 1) * 2]
    model(local, labels=local).loss.backward()
    for (name, param), (dp_name, dp_param) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        if not param.requires_grad:
            assert not dp_param.requires_grad and dp_param.grad is None, dp_name
            continue
        grad = dp_param.grad.full_tensor() if isinstance(dp_param.grad, DTensor) else dp_param.grad
        torch.testing.assert_close(grad, param.grad, rtol=1e-4, atol=1e-6, msg=f"{name} zero_stage={zero_stage}")


def _run_dp_cases(rank, world_size, stages):
    for zero_stage in stages:
        _compare_dp_lora(rank, world_size, zero_stage)


def test_dp2_ddp_and_fsdp2_adapter_grads_match_single_process():
    spawn(_run_dp_cases, 2, [0, 3], timeout=240, start_method="fork")
