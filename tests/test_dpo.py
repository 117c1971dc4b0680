"""DPO (trainer/dpo.py, trainer/train_dpo.py, DPODataset): the loss and its gradient against transformers' Qwen3 and
the formula by hand, ln 2 at step 1, the layouts against one process, exact resume, bad input."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen3ForCausalLM

from dataset.lm_dataset import DPODataset, SFTDataset
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights import minimind_to_hf
from tests.launch import ROOT, demo_slice
from trainer.dpo import DPOObjective, sequence_log_probs
from trainer.train_loop import step_targets

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
BETA = 0.15


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def pair_rows(n):
    def conversation(i, answer):
        return [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": answer}]
    return [{"chosen": conversation(i, f"{2 * i}."), "rejected": conversation(i, f"{2 * i + 1}, I think.")}
            for i in range(n)]


def test_pairs_are_sft_conversations_chosen_first(tmp_path, tokenizer):
    rows = pair_rows(3)
    ds = DPODataset(write_rows(tmp_path / "d.jsonl", rows), tokenizer, max_length=48, cache_dir=tmp_path / "c")
    for side, k in (("chosen", 0), ("rejected", 1)):  # each side as SFT would read it as a conversation file
        sft = SFTDataset(write_rows(tmp_path / f"{side}.jsonl", [{"conversations": r[side]} for r in rows]),
                         tokenizer, max_length=48, cache_dir=tmp_path / "c")
        for i in range(3):
            input_ids, labels = ds[i]
            assert input_ids.shape == labels.shape == (2, 48)
            assert torch.equal(input_ids[k], sft[i][0]) and torch.equal(labels[k], sft[i][1])
    ds.set_reference([[-1.0, -2.0]] * 3)
    assert torch.equal(ds[1][2], torch.tensor([-1.0, -2.0]))


def test_a_row_without_rejected_names_its_line_or_is_skipped(tmp_path, tokenizer):
    rows = pair_rows(4)
    del rows[2]["rejected"]
    path = write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=r"d\.jsonl:3: no 'rejected' field"):
        DPODataset(path, tokenizer, max_length=48, cache_dir=tmp_path / "c")
    ds = DPODataset(path, tokenizer, max_length=48, cache_dir=tmp_path / "c", skip_bad_lines=True)
    assert len(ds) == 3 and ds.num_bad_lines == 1
    assert "3 + 3?" in tokenizer.decode(ds[2][0][1]) and "7, I think." in tokenizer.decode(ds[2][0][1])


def hf_model(model):
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    hf_config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(hf_config)
    hf.load_state_dict(hf_sd, strict=True)
    return hf


def hand_log_probs(hf, input_ids, labels):
    """sum over the assistant tokens of log softmax(logits)[next token], written out from transformers' logits."""
    logits = hf(input_ids).logits[:, :-1].double()
    targets = labels[:, 1:]
    picked = torch.log_softmax(logits, dim=-1).gather(2, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (targets != -100)).sum(dim=1)


def test_loss_and_gradient_match_transformers_and_the_formula(tmp_path, tokenizer):
    data = demo_slice(tmp_path, "dpo", 6)
    ds = DPODataset(data, tokenizer, max_length=64, cache_dir=tmp_path / "c")
    input_ids = torch.stack([ds[i][0] for i in range(6)])  # (6, 2, 64)
    labels = torch.stack([ds[i][1] for i in range(6)])
    config = MiniMindConfig(vocab_size=len(tokenizer), **TINY)
    torch.manual_seed(0)
    policy = MiniMindForCausalLM(config)
    torch.manual_seed(1)
    reference = hf_model(MiniMindForCausalLM(config))
    hf_policy = hf_model(policy)
    rows, row_labels = input_ids.flatten(0, 1), labels.flatten(0, 1)
    with torch.no_grad():
        ref = hand_log_probs(reference, rows, row_labels).view(6, 2)
    pc, pr = hand_log_probs(hf_policy, rows, row_labels).view(6, 2).unbind(1)
    expected = -F.logsigmoid(BETA * ((pc - ref[:, 0]) - (pr - ref[:, 1]))).mean()
    expected.backward()

    objective = DPOObjective(BETA)
    x, y, positions, extra = objective.unpack((input_ids, labels, ref.float()))
    assert objective.count(y, extra) == 6
    loss, _, stats = objective.loss(policy, x, step_targets(y), positions, extra, num_items=6)
    loss.backward()
    # fp32 model against a float64 formula over fp32 logits: sums of ~40 log-probs of size ~9, rounding ~1e-5
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    hf_grads = dict(hf_policy.named_parameters())
    for name, param in policy.named_parameters():
        ref_grad = hf_grads[name].grad.float()
        scale = ref_grad.abs().max().item()
        assert (param.grad - ref_grad).abs().max().item() <= 1e-4 * scale + 1e-9, name
    record = objective.record({k: float(v) for k, v in stats.items()}, 6)
    chosen_rewards = BETA * (pc - ref[:, 0]).detach()
    rejected_rewards = BETA * (pr - ref[:, 1]).detach()
    assert record["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-5)
    assert record["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-5)
    assert record["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), abs=1e-5)
    assert record["rewards/accuracies"] == int((chosen_rewards > rejected_rewards).sum()) / 6


def test_chunked_log_probs_and_gradient_equal_the_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 17, (3, 5))
    targets[0, :2] = targets[2] = -100
    weights = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    picked = torch.log_softmax(logits, -1).gather(2, targets.clamp(min=0)[..., None]).squeeze(-1)
    expected = (picked * (targets != -100)).sum(1)
    (expected * weights).sum().backward()
    expected_grad, logits.grad = logits.grad.clone(), None
    got = sequence_log_probs(logits, targets, chunk_size=4)  # chunks cut across rows
    (got * weights).sum().backward()
    assert torch.allclose(got.double(), expected, atol=1e-5)  # the forward runs in fp32
    assert torch.allclose(logits.grad, expected_grad, atol=1e-6)
    assert got[2].item() == 0.0
