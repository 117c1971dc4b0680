"""model/weights/files.py, shapes.py, model/hf_convert.py (model/weights/flag_advice.py words the fixes): MiniMind-3
.pth files, the trainer's .pth + sidecar config, resume files and HF folders load, and mismatches are one line."""
import argparse
import json
import os

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from model.hf_convert import minimind_to_hf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import load_weights, read_weights, read_weights_and_args, save_weights_file, sidecar_path
from model.weights.flag_advice import flag_conflicts, weights_line
from model.weights.shapes import WeightsError, infer_config, shape_mismatch, weight_fields
from tests.helpers.weight_files import QWEN_VOCAB as VOCAB
from tests.helpers.weight_files import tiny_qwen3, write_minimind_folder
from trainer.plan.flags import MODEL_FLAGS
from trainer.plan.model_config import weight_shapes


def minimind3_shapes(use_moe, hidden=768, layers=8, heads=8, kv_heads=4, head_dim=96, inter=2432, experts=4,
                     vocab=6400):
    """Tensor names and shapes of MiniMind-3's MiniMindForCausalLM, written out from its public definition."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        mlps = [f"mlp.experts.{e}." for e in range(experts)] if use_moe else ["mlp."]
        if use_moe:
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for m in mlps:
            shapes.update({p + m + "gate_proj.weight": (inter, hidden), p + m + "up_proj.weight": (inter, hidden),
                           p + m + "down_proj.weight": (hidden, inter)})
    return shapes


@pytest.fixture(scope="module")
def minimind3_dense(tmp_path_factory):
    """A MiniMind-3 dense .pth (fp16, both tied names, as MiniMind saves) written from transformers' Qwen3."""
    torch.manual_seed(0)
    ref_config = Qwen3Config(vocab_size=6400, hidden_size=768, intermediate_size=2432, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=96, rope_theta=1e6,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768)
    reference = Qwen3ForCausalLM(ref_config).eval()
    state = {k: v.half() for k, v in reference.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == minimind3_shapes(use_moe=False)
    reference.load_state_dict({k: v.float() for k, v in state.items()})  # the reference sees the fp16 values too
    path = tmp_path_factory.mktemp("mm3") / "full_sft_768.pth"
    torch.save(state, path)
    return path, reference


def test_minimind3_dense_pth_loads_into_default_config_with_same_logits(minimind3_dense):
    path, reference = minimind3_dense
    state_dict, config = read_weights(str(path))
    assert config is None  # a bare .pth carries no config
    assert infer_config(state_dict) == dict(vocab_size=6400, hidden_size=768, num_hidden_layers=8, head_dim=96,
                                            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                                            use_moe=False, intermediate_size=2432)
    model = MiniMindForCausalLM(MiniMindConfig()).eval()  # no flags
    assert shape_mismatch(state_dict, model, str(path)) is None
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-5  # fp32, same math; only summation order may differ


def test_minimind3_moe_pth_loads_strict_into_default_moe_config(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=g) * 0.02).half() for k, s in minimind3_shapes(use_moe=True).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    path = tmp_path / "full_sft_768_moe.pth"
    torch.save(state, path)
    with torch.device("meta"):  # shapes are all that is checked here
        model = MiniMindForCausalLM(MiniMindConfig(use_moe=True))
    state_dict, _ = read_weights(str(path))
    inferred = infer_config(state_dict)
    assert (inferred["num_experts"], inferred["moe_intermediate_size"], inferred["n_shared_experts"]) == (4, 2432, 0)
    assert shape_mismatch(state_dict, model, str(path)) is None
    assert set(state_dict) == set(model.state_dict())
    result = model.load_state_dict(state_dict, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_shape_mismatch_names_file_tensor_shapes_and_flag(minimind3_dense):
    path, _ = minimind3_dense
    state_dict, _ = read_weights(str(path))
    with torch.device("meta"):
        old = MiniMindForCausalLM(MiniMindConfig(intermediate_size=2048))  # this project's former 8/3 default
    message = weights_line(shape_mismatch(state_dict, old, str(path)))
    assert message == (f"{path}: tensor model.layers.0.mlp.gate_proj.weight has shape [2432, 768] in the file "
                       "but [2048, 768] in the model; pass --intermediate_size 2432")


def tiny(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    return MiniMindConfig(**dict(base, **kw))


@pytest.mark.parametrize("saved,model_kw,expected", [
    (dict(), dict(hidden_size=128), "pass --hidden_size 64"),
    (dict(head_dim=32), dict(), "tensor model.layers.0.self_attn.q_proj.weight has shape [128, 64] in the file "
                                "but [64, 64] in the model; pass --head_dim 32"),
    (dict(num_key_value_heads=1), dict(), "k_proj.weight has shape [16, 64] in the file but [32, 64] in the model; "
                                          "pass --num_key_value_heads 1"),
    (dict(num_hidden_layers=3), dict(), "pass --num_hidden_layers 3"),
    (dict(use_moe=True), dict(), "model.layers.0.mlp.gate.weight shows a MoE model; pass --use_moe 1"),
    (dict(), dict(use_moe=True), "pass --use_moe 0"),
    (dict(use_moe=True, num_experts=8), dict(use_moe=True), "mlp.gate.weight has shape [8, 64] in the file but "
                                                            "[4, 64] in the model; pass --num_experts 8"),
    (dict(use_moe=True, moe_intermediate_size=96), dict(use_moe=True), "pass --moe_intermediate_size 96"),
    (dict(tie_word_embeddings=False), dict(), "(untied); pass --tie_word_embeddings 0"),
    (dict(vocab_size=600), dict(), "(vocab_size 600): --tokenizer_path"),
    (dict(use_moe=True, n_shared_experts=1), dict(use_moe=True), "tensor model.layers.0.mlp.shared_experts.0.down_proj."
                                                                 "weight has no place in this model (6 unexpected); "
                                                                 "check --use_moe / shared experts"),
])
def test_shape_mismatch_flags(saved, model_kw, expected):
    torch.manual_seed(0)
    state_dict = MiniMindForCausalLM(tiny(**saved)).state_dict()
    message = weights_line(shape_mismatch(state_dict, MiniMindForCausalLM(tiny(**model_kw)), "w.pth"))
    assert message is not None and message.startswith("w.pth: ") and "\n" not in message
    assert expected in message, message


@pytest.mark.parametrize("kw", [
    dict(),
    dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=False, intermediate_size=160),
    dict(use_moe=True, num_experts=6, moe_intermediate_size=96),
    dict(use_moe=True, n_shared_experts=1, num_hidden_layers=3),
])
def test_infer_config_recovers_the_config(kw):
    config = tiny(**kw)
    torch.manual_seed(0)
    inferred = infer_config(MiniMindForCausalLM(config).state_dict())
    fields = ["vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings", "use_moe"]
    fields += ["num_experts", "moe_intermediate_size", "n_shared_experts"] if config.use_moe else ["intermediate_size"]
    assert inferred == {f: getattr(config, f) for f in fields}


def test_resume_checkpoint_with_rng_state_reads_model_config_and_args(tmp_path):
    config = tiny(use_moe=True, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config)
    ckpt = dict(model={"module." + k: v for k, v in model.state_dict().items()}, config=config.to_dict(),
                args=dict(tokenizer_path="/somewhere/tok"), rng=dict(numpy=np.random.get_state()), format_version=1)
    torch.save(ckpt, tmp_path / "pretrain_64_moe_resume.pth")
    with pytest.raises(Exception):  # what convert_model tripped on: weights_only refuses numpy RNG state
        torch.load(tmp_path / "pretrain_64_moe_resume.pth", weights_only=True)
    state_dict, saved, args = read_weights_and_args(str(tmp_path / "pretrain_64_moe_resume.pth"))
    assert args["tokenizer_path"] == "/somewhere/tok"
    assert saved["num_experts_per_tok"] == 2 and "model_type" not in saved
    original = model.state_dict()
    assert state_dict.keys() == original.keys() and all(torch.equal(state_dict[k], original[k]) for k in original)


def test_qwen3_folders_read_as_minimind(tmp_path):
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=5e5,
                                         tie_word_embeddings=True)).eval()
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             tie_word_embeddings=False)).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, reference in (("dense", dense), ("moe", moe)):
        reference.save_pretrained(tmp_path / name)
        model = load_weights(MiniMindForCausalLM(MiniMindConfig(**read_weights(str(tmp_path / name))[1])).eval(),
                             str(tmp_path / name))
        with torch.no_grad():
            assert (model(ids).logits - reference(ids).logits).abs().max().item() < 1e-4
    assert model.config.num_experts_per_tok == 2 and not model.config.tie_word_embeddings
    assert read_weights(str(tmp_path / "dense"))[1]["rope_theta"] == 5e5


def test_minimind_format_folder_reads_with_its_config(tmp_path):
    """A folder as MiniMind's own export writes it loads without running its modeling file."""
    reference = tiny_qwen3()
    folder = write_minimind_folder(tmp_path / "minimind-3", reference)
    state_dict, config = read_weights(str(folder))
    assert config["rope_theta"] == 1e6 and config["intermediate_size"] == 256 and "auto_map" not in config
    model = load_weights(MiniMindForCausalLM(MiniMindConfig(**config)).eval(), str(folder))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() < 1e-4


def test_unusable_inputs_are_one_line_errors(tmp_path):
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(dict(model_type="llama")))
    torch.save({"step": 3}, tmp_path / "no_tensors.pth")
    torch.save({"model": {}, "args": argparse.Namespace(lr=1)}, tmp_path / "objects.pth")  # never unpickled
    cases = {str(tmp_path / "missing.pth"): "does not exist", str(tmp_path / "notes.pth"): "is not a torch weight file",
             str(tmp_path / "llama"): "model_type 'llama' is not one of qwen3, qwen3_moe, minimind",
             str(tmp_path / "no_tensors.pth"): "holds no state dict",
             str(tmp_path / "objects.pth"): "holds objects other than tensors and RNG state"}
    for path, expected in cases.items():
        with pytest.raises(WeightsError) as e:
            read_weights(path)
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_weight_fields_and_flag_conflicts():
    """What --from_weight needs: the weights' fields (tensors over saved config) and the flags that disagree."""
    config = tiny(use_moe=True, num_experts_per_tok=2, moe_intermediate_size=96)
    torch.manual_seed(0)
    state_dict = MiniMindForCausalLM(config).state_dict()
    stale = dict(config.to_dict(), moe_intermediate_size=128)  # a saved config the tensors contradict
    fields = weight_fields(state_dict, stale)
    assert (fields["moe_intermediate_size"], fields["num_experts_per_tok"], fields["num_experts"]) == (96, 2, 4)
    flags = dict(hidden_size=64, num_experts_per_tok=1, moe_intermediate_size=None, use_moe=1, num_hidden_layers=4)
    assert flag_conflicts(fields, flags) == ["--num_experts_per_tok 1 (the weights have 2)",
                                             "--num_hidden_layers 4 (the weights have 2)"]


def test_weights_file_carries_its_config_in_a_sidecar(tmp_path):
    """save_weights_file: the .pth stays a plain state dict (what MiniMind's torch.load + load_state_dict takes), and
    pretrain_64_moe.json beside it gives back what the tensors cannot show: top-k, rope_theta, aux loss weight."""
    config = tiny(use_moe=True, num_experts_per_tok=2, rope_theta=5e5, router_aux_loss_coef=0.03, loss_chunk_size=8)
    torch.manual_seed(0)
    state = {k: v.half() for k, v in MiniMindForCausalLM(config).state_dict().items()}
    path = str(tmp_path / "out" / "pretrain_64_moe.pth")
    save_weights_file(state, config, path)
    plain = torch.load(path, weights_only=True)
    assert plain.keys() == state.keys() and all(torch.equal(plain[k], state[k]) for k in state)
    sidecar = json.loads((tmp_path / "out" / "pretrain_64_moe.json").read_text())
    assert sidecar["model_type"] == "minimind" and "loss_chunk_size" not in sidecar  # a training knob, not the model
    _, fields = read_weights(path)
    expected = {f: getattr(config, f) for f in fields}
    assert fields == expected and fields["num_experts_per_tok"] == 2 and fields["rope_theta"] == 5e5
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pretrain_64_moe.json", "pretrain_64_moe.pth"]
    (tmp_path / "out" / "pretrain_64_moe.json").write_text("[1, 2")
    with pytest.raises(WeightsError, match="pretrain_64_moe.json .the config of pretrain_64_moe.pth. is not a JSON "
                                           "object .JSONDecodeError.; delete it to infer the shapes"):
        read_weights(path)


def test_from_weight_takes_top_k_from_the_sidecar(tmp_path):
    """--from_weight of the trainer's top-2 MoE .pth builds a top-2 model with no flag; a bare copy cannot know."""
    config = tiny(use_moe=True, num_experts_per_tok=2)
    path = str(tmp_path / "pretrain_64_moe.pth")
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, path)
    flags = argparse.Namespace(**{name: None for name in MODEL_FLAGS}, vocab_size=None)
    flags.use_moe = 0
    assert weight_shapes(flags, path)["num_experts_per_tok"] == 2
    os.remove(sidecar_path(path))
    assert "num_experts_per_tok" not in weight_shapes(flags, path)


def test_shared_experts_do_not_export_to_qwen3_moe_and_the_line_says_what_to_pass():
    config = tiny(use_moe=True, n_shared_experts=1)
    with pytest.raises(WeightsError) as e:
        minimind_to_hf(MiniMindForCausalLM(config).state_dict(), config)
    assert weights_line(e.value) == ("n_shared_experts=1: Qwen3-MoE has no shared experts; "
                                     "export with --format minimind instead")
    assert "--" not in str(e.value)  # model/ names no flag: model/weights/flag_advice.py adds it
