"""The reward model (trainer/stages/reward.py, trainer/train_reward.py, dataset/preference_data.RewardPairs): the
Bradley-Terry loss and its gradient against transformers' Qwen3ForSequenceClassification and the formula by hand, the
export read by GRPO/PPO's RewardModel, the layouts against one process, exact resume, bad input."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification

from dataset.chat import chat_messages
from dataset.preference_data import RewardPairs
from model.hf_convert import minimind_to_hf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.eval_reward import pair_accuracy
from tests.helpers.launch import (
    TINY_CONFIG,
    TINY_MODEL,
    demo_slice,
    forked,
    kill_at_step,
    metrics_of,
    preference_run_args,
    preference_single_run,
    resume_run,
    run_in_process,
)
from trainer import train_ppo, train_reward
from trainer.core.batches import step_targets
from trainer.rl.rewards import RewardModel
from trainer.stages.reward import RewardObjective, ScoreHead, hf_folder

SCRIPT = "trainer/train_reward.py"
STEPS = 6
METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")



def with_margins(src, dst, margins):
    """The demo pairs of `src` with TRL's "margin" column added."""
    rows = [json.loads(line) for line in open(src)]
    with open(dst, "w") as f:
        f.writelines(json.dumps(dict(r, margin=m)) + "\n" for r, m in zip(rows, margins))
    return str(dst)


def hf_classifier(model, head):
    """The trunk and head as transformers' sequence classifier, built here from the causal LM's conversion."""
    hf_config, hf_sd = minimind_to_hf(model.state_dict(), model.config)
    hf_config.num_labels, hf_config._attn_implementation = 1, "eager"
    hf = Qwen3ForSequenceClassification(hf_config)
    hf_sd = {k: v for k, v in hf_sd.items() if not k.startswith("lm_head.") and "score_head" not in k}
    hf.load_state_dict(dict(hf_sd, **{"score.weight": head.weight.detach().clone()}), strict=True)
    return hf


def test_loss_and_gradient_match_transformers_and_the_formula(tmp_path, tokenizer):
    """-logsigmoid(r_chosen - r_rejected - margin), r read by transformers' own classifier at its last non-pad token
    (float64 on its logits); the gradient of the trunk and the head equal the classifier's."""
    data = with_margins(demo_slice(tmp_path, "dpo", 5), tmp_path / "m.jsonl", [0.0, 9.0, 0.5, -1.0, 2.0])
    ds = RewardPairs(data, tokenizer, max_length=96, cache_dir=tmp_path / "c")
    assert ds.pairs.identical_rows.tolist() == [1]  # its tool schemas fill the 96 tokens: left out, its margin too
    batch = [torch.stack([ds[i][k] for i in range(4)]) for k in range(3)]
    assert batch[2].tolist() == [0.0, 0.5, -1.0, 2.0]
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), **TINY_CONFIG))
    head = ScoreHead(64, seed=3, std=0.5).attach(model)  # a large head: the pairs' rewards differ
    hf = hf_classifier(model, head)
    hf.config.pad_token_id = tokenizer.pad_token_id
    rows = batch[0].flatten(0, 1)
    scores = hf(input_ids=rows).logits[:, 0].double().view(4, 2)
    margins = batch[2].double()
    expected = -F.logsigmoid(scores[:, 0] - scores[:, 1] - margins).mean()
    expected.backward()

    objective = RewardObjective(tokenizer.pad_token_id)
    objective.head = head
    x, y, positions, extra = objective.unpack(tuple(batch))
    assert objective.count(y, extra) == 4
    loss, _, stats = objective.loss(model, x, step_targets(y), positions, extra, num_items=4)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)  # fp32 forward vs the same in transformers
    assert head.weight.grad.shape == hf.score.weight.grad.shape
    hf_grads = dict(hf.named_parameters(), **{"model.norm.score_head.weight": hf.score.weight})
    for name, param in model.named_parameters():
        if name == "lm_head.weight":  # tied: the embedding's gradient
            continue
        ref = hf_grads[name].grad.float()
        assert (param.grad - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-9, name
    record = objective.record({k: float(v) for k, v in stats.items()}, 4)
    gaps = (scores[:, 0] - scores[:, 1]).detach()
    assert record["margin"] == pytest.approx(gaps.mean().item(), abs=1e-5)
    assert record["accuracy"] == int((gaps > 0).sum()) / 4
    assert record["rewards/chosen"] == pytest.approx(scores[:, 0].mean().item(), abs=1e-5)


def test_a_bad_margin_names_its_line(tmp_path, tokenizer):
    data = with_margins(demo_slice(tmp_path, "dpo", 3), tmp_path / "m.jsonl", [1.0, "big", 0.0])
    with pytest.raises(ValueError, match=r"m\.jsonl:2: 'margin' must be a number, got \"big\""):
        RewardPairs(data, tokenizer, max_length=64, cache_dir=tmp_path / "c")
    ds = RewardPairs(demo_slice(tmp_path, "dpo", 3), tokenizer, max_length=64, cache_dir=tmp_path / "c")
    assert ds[1][2].item() == 0.0  # no column: no margin


# ----------------------------------------------------------------------------- end to end
def run_args(tmp_path, name, data, dp=1, extra=()):
    return preference_run_args(tmp_path, name, data, STEPS, dp, extra)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    argv, records, data, _ = preference_single_run(tmp_path_factory.mktemp("reward_single"), SCRIPT, "dpo", STEPS)
    return argv, records, data


def test_the_run_learns_and_its_export_scores_as_the_model(single_run, tokenizer):
    """ln 2 at step 1 up to the head's small initial scores; the HF folder loads through GRPO/PPO's RewardModel and
    scores a chat as the .pth's trunk and head do (by hand, through transformers' classifier), and so do
    scripts/eval_reward.py's pair accuracy and gap."""
    argv, records, data = single_run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=0.02)
    assert records[-1]["loss"] < records[0]["loss"] and set(METRICS) <= set(records[-1])
    weights = os.path.join(argv[argv.index("--save_dir") + 1], "reward_64.pth")
    state = torch.load(weights)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), **TINY_CONFIG))
    head = ScoreHead(64, seed=0)
    head.weight.data.copy_(state.pop("score.weight"))
    model.load_state_dict(state)
    hf = hf_classifier(model, head)
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}]
    ids = torch.tensor([tokenizer(tokenizer.apply_chat_template(chat, tokenize=False))["input_ids"]])
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0, 0].item()
    reward_model = RewardModel(hf_folder(weights), "cpu")
    got = reward_model([chat[:1]], [[chat[1]]])
    assert got[0] == pytest.approx(expected, abs=1e-5)
    # scripts/eval_reward.py: the pairs' accuracy and mean gap, by hand through the classifier built here (pairs whose
    # gap is clear of 0: the two models' attention kernels round differently)
    rows, gaps = [json.loads(line) for line in open(data)][:8], []
    for row in rows:
        texts = [tokenizer.apply_chat_template(*chat_messages(row[side]), tokenize=False)  # (messages, tools)
                 for side in ("chosen", "rejected")]
        sides = [torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]) for text in texts]
        with torch.no_grad():
            gaps.append(hf(input_ids=sides[0]).logits[0, 0].item() - hf(input_ids=sides[1]).logits[0, 0].item())
    clear = [k for k, g in enumerate(gaps) if abs(g) > 1e-3]
    accuracy, gap = pair_accuracy(reward_model, [rows[k] for k in clear], 4096)
    assert len(clear) >= 4 and accuracy == sum(gaps[k] > 0 for k in clear) / len(clear)
    assert gap == pytest.approx(sum(gaps[k] for k in clear) / len(clear), abs=1e-5)


def test_tp2_equals_the_single_process(single_run, tmp_path):
    """The reward model's own loss under sharding: the score head reads the tensor-parallel trunk's final norm (a
    Replicate DTensor), its scores taken at each row's last token, the LM head on one position of vocab-sharded
    logits. The same head class under FSDP2 (ZeRO-3) is PPO's value head: tests/test_ppo.py's zero3 layout; pairs
    counted over dp ranks: tests/test_dpo.py::test_dp2_x_pp2_equals_the_single_process; the loop and wrap in every
    layout: tests/test_layouts.py."""
    argv, records, data = single_run
    run = run_args(tmp_path, "layout", data, dp=1, extra=["--tp", "2"])
    proc = forked(SCRIPT, nproc=2, args=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics_of(run)
    assert [r["step"] for r in got] == [r["step"] for r in records]
    for a, b in zip(got, records):  # another reduction order (tp's sharded matmuls): fp32 rounding, as DPO's
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["accuracy"] == b["accuracy"], a["step"]
        # the margin is a difference of two scores (cancellation): its rounding is relative to the scores, not to it
        assert a["margin"] == pytest.approx(b["margin"], rel=1e-3, abs=1e-5), (a["step"], a["margin"], b["margin"])


def test_resume_after_a_kill_continues_with_the_same_losses(single_run, tmp_path):
    argv, records, data = single_run
    run = run_args(tmp_path, "killed", data, extra=["--save_interval", "1"])
    kill_at_step("train_reward", run, 3)
    resume_run(SCRIPT, run, 3)
    got = metrics_of(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, records):  # same process count, same reduction order: the same values
        assert a["loss"] == b["loss"] and a["margin"] == b["margin"], (a, b)


def test_bad_input_is_one_line_and_exit_2(single_run, tmp_path, monkeypatch, capsys):
    """--packing with the reward model; a causal LM folder (or the .pth) given to PPO as --reward_model."""
    argv, _, _ = single_run
    data = argv[argv.index("--data_path") + 1]
    code, err = run_in_process(monkeypatch, capsys, train_reward, [*run_args(tmp_path, "pk", data), "--packing", "1"])
    assert code == 2 and err == ["error: --packing 1: the reward model keeps each conversation in its own row; leave "
                                 "it out"], err
    causal = tmp_path / "causal"
    model = MiniMindForCausalLM(MiniMindConfig(**TINY_CONFIG))
    hf_config, _ = minimind_to_hf(model.state_dict(), model.config)
    Qwen3ForCausalLM(hf_config).save_pretrained(causal)  # the causal LM a user might pass by mistake
    capsys.readouterr()  # its progress bar
    weights = os.path.join(argv[argv.index("--save_dir") + 1], "reward_64.pth")
    for given, line in ((causal, f"error: --reward_model {causal} is a Qwen3ForCausalLM, not a reward model (its score "
                                 "head would be random); train one with trainer/train_reward.py and pass its "
                                 "out/reward_<hidden>_hf folder"),
                        (weights, f"error: --reward_model {weights} is not a folder (a Hugging Face "
                                  f"AutoModelForSequenceClassification); pass {hf_folder(weights)}, its sequence "
                                  "classifier")):
        code, err = run_in_process(monkeypatch, capsys, train_ppo, [*TINY_MODEL, "--from_weight", "none",
                                                                     "--reward_model", given])
        assert code == 2 and err == [line], err
