"""trainer/parallel/perf.py, the chunked cross-entropy and pretokenized shards, each against the plain path."""
import copy
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataset.chat import SFTDataset
from dataset.lm_dataset import PretrainDataset
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, chunked_cross_entropy
from tests.helpers.launch import forked
from trainer.observe.metrics import cuda_table_peak, enable_tf32, peak_flops
from trainer.parallel.perf import apply_activation_checkpointing, compile_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 300


def tiny_model(use_moe=False, seed=0):
    torch.manual_seed(seed)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=VOCAB, use_moe=use_moe, num_experts=4, num_experts_per_tok=2)
    return MiniMindForCausalLM(config)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (3, 40), generator=g)
    targets = F.pad(x[:, 1:], (0, 1), value=-100)
    targets[1, 25:] = -100  # padding: ignored targets
    return x, targets


def loss_and_grads(model, x, targets):
    """Trainer-style loss (CE sum / items + aux) and a copy of every gradient, by FQN."""
    model.zero_grad(set_to_none=True)
    out = model(x, shift_labels=targets, num_items_in_batch=int((targets != -100).sum()) + 5)
    (out.loss + out.aux_loss).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(out, grads, ref_out, ref_grads, tol=1e-5):
    assert abs(out.loss.item() - ref_out.loss.item()) < tol
    assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) < tol
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=tol, rtol=tol, msg=name)


# ---------------------------------------------------------------------------------------------- chunked CE
@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("chunk", [7, 16, 1000])
def test_chunked_loss_and_grads_equal_full_path(use_moe, chunk):
    model = tiny_model(use_moe)
    x, targets = batch()
    ref_out, ref_grads = loss_and_grads(model, x, targets)
    assert ref_out.logits is not None
    model.config.loss_chunk_size = chunk
    out, grads = loss_and_grads(model, x, targets)
    assert out.logits is None  # loss-only call: no full logits
    assert_same(out, grads, ref_out, ref_grads)


def test_chunked_loss_labels_no_grad_and_generation():
    model = tiny_model()
    x, _ = batch()
    ref = model(x, labels=x)
    model.config.loss_chunk_size = 16
    with torch.no_grad():
        out = model(x, labels=x)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-5
    assert model(x).logits.shape == (3, 40, VOCAB)  # no labels: logits as before (generation)


def test_chunked_cross_entropy_all_ignored_is_zero():
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, weight, torch.full((2, 5), -100), 4)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_chunked_loss_under_bf16_autocast_matches():
    model = tiny_model()
    x, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out, ref_grads = loss_and_grads(model, x, targets)
        model.config.loss_chunk_size = 16
        out, grads = loss_and_grads(model, x, targets)
    assert abs(out.loss.item() - ref_out.loss.item()) < 1e-3
    for name in grads:  # bf16 rounding happens per chunk instead of once
        scale = ref_grads[name].abs().max().item() + 1e-6
        assert (grads[name] - ref_grads[name]).abs().max().item() < 0.05 * scale, name


# ---------------------------------------------------------------------------------------------- checkpointing
def saved_activation_bytes(model, x, targets):
    """Bytes autograd keeps from the forward for the backward (the tensors a checkpointed region does not keep)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # a storage once, however many views
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, shift_labels=targets, num_items_in_batch=int((targets != -100).sum()))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params), out


@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("mode", ["full", "attention", "mlp"])
def test_activation_checkpointing_same_loss_grads_and_names(use_moe, mode):
    """Each mode recomputes in backward what it dropped: the same loss and gradients as no checkpointing, the same
    parameter names, and less kept activation memory (full < either sub-layer < none)."""
    model = tiny_model(use_moe)
    x, targets = batch()
    ref_out, ref_grads = loss_and_grads(model, x, targets)
    keys = list(model.state_dict())
    ckpt_model = apply_activation_checkpointing(tiny_model(use_moe), mode)  # same seed: same weights
    kept = {name: saved_activation_bytes(m, x, targets)[0] for name, m in (
        ("none", model), (mode, ckpt_model), ("full", apply_activation_checkpointing(tiny_model(use_moe))))}
    assert kept["full"] < kept[mode] < kept["none"] if mode != "full" else kept["full"] < kept["none"], kept
    assert list(ckpt_model.state_dict()) == keys
    out, grads = loss_and_grads(ckpt_model, x, targets)
    assert_same(out, grads, ref_out, ref_grads)
    # combined with the chunked loss
    ckpt_model.config.loss_chunk_size = 16
    out, grads = loss_and_grads(ckpt_model, x, targets)
    assert_same(out, grads, ref_out, ref_grads)


def test_activation_checkpointing_survives_deepcopy_and_eval():
    model = apply_activation_checkpointing(tiny_model())
    copied = copy.deepcopy(model)
    block = copied.model.layers[0]
    assert block.forward.__self__ is block  # rebound to the copy, not the original block
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(copied(x).logits, model(x).logits)


def test_compile_blocks_keeps_fqns_and_values():
    """torch.compile on CPU compiles with the C++ toolchain (gcc, installed on every machine this runs on): a compile
    error fails the test. Tiny model."""
    model = tiny_model()
    x, targets = batch()
    ref_out, ref_grads = loss_and_grads(model, x, targets)
    keys = list(model.state_dict())
    compiled = compile_blocks(tiny_model())
    assert list(compiled.state_dict()) == keys
    out, grads = loss_and_grads(compiled, x, targets)
    assert_same(out, grads, ref_out, ref_grads, tol=1e-4)


def test_compiled_blocks_under_bf16_autocast_keep_the_eager_loss():
    """The laptop path (--dtype bfloat16 --use_compile 1): inductor fuses the blocks' casts and elementwise work, so
    it rounds to bf16 in other places than eager autocast; the loss stays within bf16's rounding of eager's (2^-8
    relative: one rounding of the loss itself), over two optimizer steps. Tiny model, chunked loss."""
    losses = []
    for model in (tiny_model(), compile_blocks(tiny_model())):
        model.config.loss_chunk_size = 16
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for seed in (1, 2):
            x, targets = batch(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, shift_labels=targets, num_items_in_batch=int((targets != -100).sum()))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out.loss.item())
    eager, compiled = losses[:2], losses[2:]
    assert compiled == pytest.approx(eager, rel=2 ** -8), (eager, compiled)


# ---------------------------------------------------------------------------------------------- pretokenized

def write_corpus(path, n=40):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "你好", "世界", "x = 1", "def f():"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(1, 60))))},
                               ensure_ascii=False) + "\n")
    return str(path)


def pretokenize(args):
    proc = forked("scripts/pretokenize.py", args, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("packing", [False, True])
def test_pretokenized_dataset_equals_on_the_fly(tokenizer, tmp_path, packing):
    source = write_corpus(tmp_path / "corpus.jsonl")
    pretokenize(["--data_path", source, "--out_dir", str(tmp_path / "shards")])
    shard = tmp_path / "shards" / "corpus.bin"
    assert shard.exists() and (tmp_path / "shards" / "corpus.idx").exists()
    on_the_fly = PretrainDataset(source, tokenizer, max_length=32, packing=packing, cache_dir=str(tmp_path / "cache"))
    from_shard = PretrainDataset(str(shard), tokenizer, max_length=32, packing=packing)
    assert len(from_shard) == len(on_the_fly) > 0
    for i in range(len(on_the_fly)):
        for a, b in zip(from_shard[i], on_the_fly[i]):
            assert torch.equal(a, b)
    assert np.memmap(shard, dtype=np.uint16, mode="r").size == on_the_fly.offsets[-1]


def test_pretokenized_sft_equals_on_the_fly(tokenizer, tmp_path):
    conversation = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}]
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join(json.dumps({"conversations": conversation}) for _ in range(3)) + "\n")
    pretokenize(["--data_path", str(source), "--kind", "sft"])
    on_the_fly = SFTDataset(str(source), tokenizer, max_length=64, cache_dir=str(tmp_path / "cache"))
    from_shard = SFTDataset(str(tmp_path / "chat.bin"), tokenizer, max_length=64)
    for a, b in zip(from_shard[2], on_the_fly[2]):
        assert torch.equal(a, b)
    # a shard of chat rows tokenized before the generation prompt's cut (format 2) would train on other tokens
    meta_path = tmp_path / "chat.json"
    meta_path.write_text(json.dumps(dict(json.loads(meta_path.read_text()), format_version=2)))
    with pytest.raises(ValueError) as caught:
        SFTDataset(str(tmp_path / "chat.bin"), tokenizer, max_length=64)
    assert str(caught.value) == (f"{tmp_path / 'chat.bin'} holds sft tokens of format 2, this version reads 3; "
                                 "rebuild it with scripts/pretokenize.py")


def test_pretokenized_shard_checks_kind_and_tokenizer(tokenizer, tmp_path):
    source = write_corpus(tmp_path / "corpus.jsonl", n=5)
    pretokenize(["--data_path", source])
    meta_path = tmp_path / "corpus.json"
    with pytest.raises(ValueError, match="pretrain data, not sft"):
        SFTDataset(str(tmp_path / "corpus.bin"), tokenizer, max_length=16)
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, tokenizer="other")))
    with pytest.raises(ValueError, match="another tokenizer"):
        PretrainDataset(str(tmp_path / "corpus.bin"), tokenizer, max_length=16)
    os.remove(tmp_path / "corpus.idx")
    with pytest.raises(FileNotFoundError, match="corpus.idx"):
        PretrainDataset(str(tmp_path / "corpus.bin"), tokenizer, max_length=16)


def test_cuda_peak_table_dense_figures():
    """Datasheet dense peaks by the names torch.cuda.get_device_name reports; variants are not taken for the base."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert cuda_table_peak("NVIDIA H100 80GB HBM3", bf16, tf32=True) == 989.4e12
    assert cuda_table_peak("NVIDIA H100 PCIe", fp16, tf32=True) == 756e12
    assert cuda_table_peak("NVIDIA H100 NVL", bf16, tf32=False) == 835e12
    assert cuda_table_peak("NVIDIA H200", fp32, tf32=True) == 989.4e12 / 2  # TF32 runs at half the bf16 rate
    assert cuda_table_peak("NVIDIA H200", fp32, tf32=False) == 66.9e12  # strict fp32: no tensor cores
    assert cuda_table_peak("NVIDIA A100-SXM4-80GB", fp32, tf32=True) == 156e12
    assert cuda_table_peak("NVIDIA L40S", bf16, tf32=True) == 362.05e12  # not the L40's 181
    assert cuda_table_peak("NVIDIA GeForce RTX 4090", bf16, tf32=True) == 165.2e12  # dense, fp32 accumulate
    assert cuda_table_peak("NVIDIA GeForce RTX 3090", bf16, tf32=True) == 71e12
    assert cuda_table_peak("NVIDIA T4", bf16, tf32=True) is None  # unlisted: measured instead


def test_cpu_peak_is_measured_and_tf32_is_cuda_only():
    """A CPU's peak is a probe's measured rate: between the 1-thread rate of a 2-FLOP/cycle core at 0.1 GHz and
    a 2048-FLOP/cycle, 5 GHz, all-thread machine. enable_tf32 leaves CPU matmuls exact; on CUDA it picks TF32."""
    peak = peak_flops("cpu", torch.float32)
    assert 2e8 <= peak <= 2048 * 5e9 * torch.get_num_threads()
    before = torch.get_float32_matmul_precision()
    try:
        enable_tf32("cpu", strict=False)
        assert torch.get_float32_matmul_precision() == before
        enable_tf32("cuda", strict=False)
        assert torch.get_float32_matmul_precision() == "high"
        enable_tf32("cuda", strict=True)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
