"""What scripts/gpu_check.py runs on a GPU (marker `cuda`): each test takes the CUDA device when there is one.

On CPU they run as well, so the GPU run meets no test it has never seen pass.
"""
import pytest
import torch

from tests.helpers.models import batch, max_diff, minimind, packed_row, tiny_config, to_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def strict_fp32():
    """fp32 comparisons in true fp32: TF32 off for the test (the trainer turns it on for speed)."""
    if DEVICE != "cuda":
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("use_moe", [False, True])
def test_parity_with_transformers_fp32_and_bf16(use_moe):
    """fp32: the same function as transformers' Qwen3 (1e-4). bf16 autocast: our error against the fp32 result is
    within twice transformers' own bf16 error (both round the same matmuls to bf16; the order may differ)."""
    model = minimind(tiny_config(use_moe=use_moe, num_experts_per_tok=2))
    hf = to_hf_model(model).to(DEVICE)
    model, x = model.to(DEVICE), batch().to(DEVICE)
    with torch.no_grad():
        ours, ref = model(x).logits.float(), hf(x).logits.float()
        assert max_diff(ours, ref) < 1e-4
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            ours_bf16, ref_bf16 = model(x).logits.float(), hf(x).logits.float()
    assert max_diff(ours_bf16, ref) <= 2 * max_diff(ref_bf16, ref) + 1e-6


@pytest.mark.parametrize("use_moe", [False, True])
def test_chunked_loss_equals_full_logits(use_moe):
    """lm_head + CE in chunks of 8 tokens (never the full logits): the loss and every gradient of the full path."""
    x = batch(seq=40).to(DEVICE)
    targets = x.roll(-1, 1)
    targets[:, -1] = -100
    targets[0, :7] = -100  # ignored targets are dropped before the lm_head
    losses, grads = [], []
    for chunk in (0, 8):
        model = minimind(tiny_config(use_moe=use_moe, loss_chunk_size=chunk)).to(DEVICE).train()
        out = model(x, shift_labels=targets, num_items_in_batch=int((targets != -100).sum()))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=0)
    for name, grad in grads[0].items():
        assert max_diff(grad, grads[1][name]) <= 1e-5 * grad.abs().max().item() + 1e-7, name


def test_document_mask_equals_each_document_alone():
    """Packed rows with position ids (FlexAttention's block mask on CUDA, the dense mask on CPU): each document's
    logits and its tokens' gradients are those of the document run alone."""
    model = minimind(tiny_config()).to(DEVICE)
    row, positions, docs = packed_row()
    row, positions, docs = row.to(DEVICE), positions.to(DEVICE), [d.to(DEVICE) for d in docs]
    packed = model(row, position_ids=positions).logits
    alone = torch.cat([model(doc).logits for doc in docs], dim=1)
    assert max_diff(packed, alone) < 1e-4
    grads = [torch.autograd.grad(logits.square().sum(), model.lm_head.weight)[0] for logits in (packed, alone)]
    assert max_diff(*grads) <= 1e-5 * grads[1].abs().max().item()


@pytest.mark.parametrize("use_moe", [False, True])
def test_greedy_generate_equals_full_forward_loop(use_moe):
    """generate() (KV cache, transformers' GenerationMixin) greedy: the tokens of a loop that runs the whole sequence
    through the model at every step and appends the argmax (fp32, TF32 off; no cache involved in the reference)."""
    model = minimind(tiny_config(use_moe=use_moe, num_experts_per_tok=2)).to(DEVICE)
    prompt = batch(bsz=2, seq=10).to(DEVICE)
    new_tokens = 16
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        ids = prompt
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated.shape == ids.shape == (2, 10 + new_tokens)
    assert torch.equal(generated, ids)
