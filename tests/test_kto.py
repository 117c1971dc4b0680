"""KTO (trainer/stages/kto.py, trainer/train_kto.py, dataset/preference_data.KTODataset): the rows and their KL rows,
the loss with its KL baseline and its gradient against transformers' Qwen3 and the formula by hand, the layouts
against one process, exact resume, bad input."""
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dataset.preference_data import KTODataset
from model.hf_convert import minimind_to_hf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import (
    TINY_CONFIG,
    demo_slice,
    forked,
    kill_at_step,
    metrics_of,
    preference_run_args,
    preference_single_run,
    resume_run,
    write_rows,
)
from trainer import train_kto
from trainer.base.launch import main_guard
from trainer.core.batches import step_targets
from trainer.stages.kto import KTOObjective

SCRIPT = "trainer/train_kto.py"
STEPS = 6




def labelled_rows(n):
    return [{"conversations": [{"role": "user", "content": f"What is {i} + {i}?"},
                               {"role": "assistant", "content": f"{2 * i + i % 2}."}], "label": i % 2 == 0}
            for i in range(n)]


def test_a_row_and_its_kl_row_the_prompt_with_the_next_answer(tmp_path, tokenizer):
    ds = KTODataset(write_rows(tmp_path / "k.jsonl", labelled_rows(3)), tokenizer, max_length=48,
                    cache_dir=tmp_path / "c")
    assert len(ds) == 3 and ds.desirable.tolist() == [1.0, 0.0, 1.0]
    for i, answer in ((0, "3."), (2, "0.")):  # row 2's KL row: its prompt, row 0's answer (the file wraps)
        input_ids, labels, desirable = ds[i]
        assert input_ids.shape == labels.shape == (2, 48)
        text = tokenizer.decode(input_ids[1][input_ids[1] != tokenizer.pad_token_id])
        assert f"What is {i} + {i}?" in text and text.endswith(answer + "<|im_end|>\n"), text
        assert tokenizer.decode(labels[1][labels[1] != -100]) == tokenizer.decode(
            ds[(i + 1) % 3][1][0][ds[(i + 1) % 3][1][0] != -100])  # the KL row learns the other row's answer


def test_a_row_without_its_label_names_its_line_or_is_skipped(tmp_path, tokenizer):
    rows = labelled_rows(4)
    del rows[2]["label"]
    rows[3]["label"] = "yes"
    path = write_rows(tmp_path / "k.jsonl", rows)
    with pytest.raises(ValueError, match=r"k\.jsonl:3: no 'label' field"):
        KTODataset(path, tokenizer, max_length=48, cache_dir=tmp_path / "c")
    ds = KTODataset(path, tokenizer, max_length=48, cache_dir=tmp_path / "c", skip_bad_lines=True)
    assert len(ds) == 2 and ds.num_bad_lines == 2


@pytest.mark.parametrize("label", [True, False])
def test_rows_of_one_label_only_are_refused_in_one_line(tmp_path, tokenizer, label):
    rows = [dict(row, label=label) for row in labelled_rows(4)]
    path = write_rows(tmp_path / "k.jsonl", rows)
    with pytest.raises(ValueError) as refused:
        KTODataset(path, tokenizer, max_length=48, cache_dir=tmp_path / "c")
    have, lack = ("true", "false") if label else ("false", "true")
    assert str(refused.value) == (f'{path}: all 4 usable rows have "label": {have}; KTO needs rows of both labels: '
                                  f'add rows with "label": {lack}')


def test_a_step_without_undesirable_rows_logs_no_reward_for_them():
    """The step's metrics hold the means of the sides it has: no rewards/rejected (nor margins) of 0.0 for rows that
    do not exist."""
    objective = KTOObjective(0.1, 1.0, 1.0)
    objective.kl = torch.tensor(0.25)
    stats = dict(chosen_reward_sum=0.6, chosen_count=3.0, rejected_reward_sum=0.0, rejected_count=0.0)
    assert objective.record(stats, 3) == {"rewards/chosen": pytest.approx(0.2), "kl": 0.25}
    both = objective.record(dict(stats, rejected_reward_sum=-0.5, rejected_count=2.0), 5)
    assert both == {"rewards/chosen": pytest.approx(0.2), "rewards/rejected": -0.25,
                    "rewards/margins": pytest.approx(0.45), "kl": 0.25}


def hand_log_probs(hf, input_ids, labels):
    """sum over the answer's tokens of log softmax(logits)[next token], from transformers' logits, float64."""
    logits = hf(input_ids).logits[:, :-1].double()
    targets = labels[:, 1:]
    picked = torch.log_softmax(logits, dim=-1).gather(2, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (targets != -100)).sum(dim=1)


@pytest.mark.parametrize("kl_shift", [-3.0, 2.0], ids=["kl_clamped_at_0", "kl_positive"])
def test_loss_and_gradient_match_transformers_and_the_formula(tmp_path, tokenizer, kl_shift):
    """Four rows (two desirable), the reference away from the policy; z0 = max(0, mean KL-row log-ratio), no
    gradient through it; weights 1.5 / 0.5."""
    beta, w_d, w_u = 0.3, 1.5, 0.5
    ds = KTODataset(demo_slice(tmp_path, "kto", 4), tokenizer, max_length=64, cache_dir=tmp_path / "c")
    input_ids, labels, desirable = (torch.stack([ds[i][k] for i in range(4)]) for k in range(3))
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), **TINY_CONFIG))
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    hf_config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(hf_config)
    hf.load_state_dict(hf_sd, strict=True)
    with torch.no_grad():
        kl_policy = hand_log_probs(hf, input_ids[:, 1], labels[:, 1])
    offsets = torch.tensor([[0.4, -1.0], [-0.6, 0.5], [1.1, 0.2], [-0.3, -0.9]], dtype=torch.float64)
    policy = hand_log_probs(hf, input_ids[:, 0], labels[:, 0])
    reference = torch.stack([policy.detach(), kl_policy], 1) + offsets
    reference[:, 1] += kl_shift  # the KL rows' log-ratio: -offsets - kl_shift
    kl = max(0.0, float((kl_policy - reference[:, 1]).mean()))
    assert (kl == 0.0) == (kl_shift > 0)
    ratio = policy - reference[:, 0]
    losses = [w_d * (1 - torch.sigmoid(beta * (r - kl))) if d else w_u * (1 - torch.sigmoid(beta * (kl - r)))
              for r, d in zip(ratio, desirable.tolist())]
    expected = torch.stack(losses).mean()
    expected.backward()

    objective = KTOObjective(beta, w_d, w_u)
    plan = SimpleNamespace(layout=SimpleNamespace(device="cpu", tp=1), model=SimpleNamespace(autocast_dtype=None))
    trainer = SimpleNamespace(plan=plan, model_parts=[model])
    (batch,) = objective.prepare(trainer, [(input_ids, labels, desirable, reference.float())])
    assert float(objective.kl) == pytest.approx(kl, abs=1e-4)  # fp32 sums of ~40 log-probs of size ~9
    x, y, positions, extra = objective.unpack(batch)
    assert objective.count(y, extra) == 4
    loss, _, stats = objective.loss(model, x, step_targets(y), positions, extra, num_items=4)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    hf_grads = dict(hf.named_parameters())
    for name, param in model.named_parameters():
        ref = hf_grads[name].grad.float()
        assert (param.grad - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-9, name
    record = objective.record({k: float(v) for k, v in stats.items()}, 4)
    wanted = desirable > 0.5
    assert record["rewards/chosen"] == pytest.approx(beta * ratio[wanted].mean().item(), abs=1e-5)
    assert record["rewards/rejected"] == pytest.approx(beta * ratio[~wanted].mean().item(), abs=1e-5)


# ----------------------------------------------------------------------------- end to end
def run_args(tmp_path, name, data, dp=1, extra=()):
    return preference_run_args(tmp_path, name, data, STEPS, dp, extra)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    argv, records, data, _ = preference_single_run(tmp_path_factory.mktemp("kto_single"), SCRIPT, "kto", STEPS)
    return argv, records, data


def test_first_step_is_one_half_with_no_kl(single_run):
    """The policy is the reference at step 1: every log-ratio and z0 are 0, each row's loss 1 - sigmoid(0)."""
    _, records, _ = single_run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(0.5, abs=1e-6) and records[0]["kl"] == pytest.approx(0, abs=1e-5)
    assert records[0]["rewards/chosen"] == pytest.approx(0, abs=1e-4)
    assert any(r["kl"] > 0 for r in records) or any(r["loss"] != records[0]["loss"] for r in records)


@pytest.mark.parametrize("layout", [["--zero_stage", "0"], ["--tp", "2"]], ids=["ddp2", "tp2"])
def test_layouts_equal_the_single_process(single_run, tmp_path, layout):
    argv, records, data = single_run
    run = run_args(tmp_path, "layout", data, dp=1 if "--tp" in layout else 2, extra=layout)
    proc = forked(SCRIPT, nproc=2, args=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics_of(run)
    assert [r["step"] for r in got] == [r["step"] for r in records]
    for a, b in zip(got, records):  # other reduction orders: fp32 rounding, as DPO's
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-5), (a["step"], a["kl"], b["kl"])


def test_resume_after_a_kill_continues_with_the_same_losses(single_run, tmp_path):
    argv, records, data = single_run
    run = run_args(tmp_path, "killed", data, extra=["--save_interval", "1"])
    kill_at_step("train_kto", run, 3)
    resume_run(SCRIPT, run, 3)
    got = metrics_of(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, records):  # same process count, same reduction order: the same values
        assert a["loss"] == b["loss"] and a["kl"] == b["kl"], (a, b)


def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    rows = labelled_rows(8)
    del rows[4]["label"]
    data = write_rows(tmp_path / "bad.jsonl", rows)
    for extra, line in (([], f"{data}:5: no 'label' field"), (["--undesirable_weight", "0"],
                                                              "--undesirable_weight must be > 0, got 0.0")):
        monkeypatch.setattr(sys, "argv", ["train_kto.py", *run_args(tmp_path, "bad", data, extra=extra)])
        with pytest.raises(SystemExit) as exit_info:
            main_guard(train_kto.main)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and err[-1].startswith("error: ") and err[-1].endswith(line), err
