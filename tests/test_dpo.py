"""DPO (trainer/stages/dpo.py, trainer/train_dpo.py, DPODataset): the loss and its gradient against transformers' Qwen3
and the formula by hand, ln 2 at step 1, the layouts against one process, exact resume, bad input."""
import glob
import hashlib
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from dataset.chat import SFTDataset
from dataset.preference_data import DPODataset
from model.hf_convert import minimind_to_hf
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from tests.helpers.launch import (
    TINY_CONFIG,
    demo_slice,
    forked,
    kill_at_step,
    metrics_of,
    preference_run_args,
    preference_single_run,
    resume_run,
    run_in_process,
    write_rows,
)
from trainer import train_dpo
from trainer.base.launch import setup_seed
from trainer.core.batches import step_targets
from trainer.parallel.pipeline import PipelineLoss
from trainer.stages.dpo import DPOObjective, sequence_log_probs

BETA = 0.15




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


def test_an_empty_side_is_named(tmp_path, tokenizer):
    """An empty list on one side: the line names that side, not SFT's 'conversations'."""
    for side in ("rejected", "chosen"):
        rows = pair_rows(4)
        rows[2][side] = []
        with pytest.raises(ValueError) as refused:
            DPODataset(write_rows(tmp_path / f"{side}.jsonl", rows), tokenizer, max_length=48, cache_dir=tmp_path / "c")
        assert str(refused.value).endswith(f"{side}.jsonl:3: '{side}' must be a non-empty list of messages"), refused


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


def test_mfu_counts_the_lm_head_on_every_position():
    """DPO's log-probs come from the full logits: MFU's FLOPs are 6 x every Linear weight + causal attention per
    position (by hand), even where the chunked loss would run the lm_head on target tokens only."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    weights = sum(m.weight.numel() for m in MiniMindForCausalLM(config).modules() if isinstance(m, torch.nn.Linear))
    seq, positions = 32, 100
    per_position = 6 * weights + 2 * 6 * 64 * seq  # layers x (QK^T + AV: 4 x q_dim x seq / 2 causal, x3 fwd+bwd)
    for chunked in (False, True):
        assert DPOObjective(0.1).flops(config, seq, positions, 40, chunked) == positions * per_position



def formula_over_transformers(input_ids, labels, tokenizer):
    """Our tiny policy, transformers' Qwen3 of its weights and of a reference, and the DPO loss by the formula over
    transformers' log-probs of the two separate rows (backward done: hf_policy's parameters hold its gradients)."""
    n = len(input_ids)
    config = MiniMindConfig(vocab_size=len(tokenizer), **TINY_CONFIG)
    torch.manual_seed(0)
    policy = MiniMindForCausalLM(config)
    torch.manual_seed(1)
    reference = hf_model(MiniMindForCausalLM(config))
    hf_policy = hf_model(policy)
    rows, row_labels = input_ids.flatten(0, 1), labels.flatten(0, 1)
    with torch.no_grad():
        ref = hand_log_probs(reference, rows, row_labels).view(n, 2)
    pc, pr = hand_log_probs(hf_policy, rows, row_labels).view(n, 2).unbind(1)
    expected = -F.logsigmoid(BETA * ((pc - ref[:, 0]) - (pr - ref[:, 1]))).mean()
    expected.backward()
    return policy, hf_policy, reference, rows, ref, pc, pr, expected


def test_loss_and_gradient_match_transformers_and_the_formula(tmp_path, tokenizer):
    data = demo_slice(tmp_path, "dpo", 6)
    ds = DPODataset(data, tokenizer, max_length=64, cache_dir=tmp_path / "c")
    n = len(ds)  # the demo slice's pairs less those the same within 64 tokens (left out)
    assert n >= 4, n
    input_ids = torch.stack([ds[i][0] for i in range(n)])  # (n, 2, 64)
    labels = torch.stack([ds[i][1] for i in range(n)])
    policy, hf_policy, reference, rows, ref, pc, pr, expected = formula_over_transformers(input_ids, labels, tokenizer)

    objective = DPOObjective(BETA)
    x, y, positions, extra = objective.unpack((input_ids, labels, ref.float()))
    assert objective.count(y, extra) == n
    loss, _, stats = objective.loss(policy, x, step_targets(y), positions, extra, num_items=n)
    loss.backward()
    # fp32 model against a float64 formula over fp32 logits: sums of ~40 log-probs of size ~9, rounding ~1e-5
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    hf_grads = dict(hf_policy.named_parameters())
    for name, param in policy.named_parameters():
        ref_grad = hf_grads[name].grad.float()
        scale = ref_grad.abs().max().item()
        assert (param.grad - ref_grad).abs().max().item() <= 1e-4 * scale + 1e-9, name
    record = objective.record({k: float(v) for k, v in stats.items()}, n)
    chosen_rewards = BETA * (pc - ref[:, 0]).detach()
    rejected_rewards = BETA * (pr - ref[:, 1]).detach()
    assert record["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-5)
    assert record["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-5)
    assert record["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), abs=1e-5)
    assert record["rewards/accuracies"] == int((chosen_rewards > rejected_rewards).sum()) / n


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


def test_the_pipeline_loss_gets_each_micro_batch_its_own_reference():
    """Pipeline.step packs the extras behind the targets; the schedule cuts rows into micro-batches (tensor_split)."""
    targets = torch.randint(-100, 50, (8, 5))
    reference = [torch.randn(4, 1) * 100, torch.randn(4, 1) * 100]  # two micro-batches of two pairs (4 rows)
    loss = PipelineLoss(objective=DPOObjective(BETA))
    packed = loss.pack(targets, [(reference[0],), (reference[1],)])
    for k, micro in enumerate(packed.tensor_split(2)):
        got_targets, (got_reference,) = loss.unpack(micro)
        assert torch.equal(got_targets, targets[4 * k:4 * k + 4]) and torch.equal(got_reference, reference[k])
    assert loss.pack(targets, ((), ())) is targets  # LM: no extras, the targets untouched
    got_targets, extra = loss.unpack(targets)
    assert torch.equal(got_targets, targets) and extra == ()


# ----------------------------------------------------------------------------- end to end
SCRIPT = "trainer/train_dpo.py"
STEPS = 6
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def run_args(tmp_path, name, data, dp=1, extra=()):
    return preference_run_args(tmp_path, name, data, STEPS, dp, extra)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The single-process run every other run is compared with: (its argv, its records, the data file)."""
    argv, records, data, stdout = preference_single_run(tmp_path_factory.mktemp("dpo_single"), SCRIPT, "dpo",
                                                        STEPS)
    assert "--from_weight none" in stdout and "reference" in stdout
    return argv, records, data


def test_first_step_is_ln2_and_the_reference_is_the_starting_model(single_run, tokenizer):
    argv, records, data = single_run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # the policy is the reference at step 1: every margin is 0 up to fp32 rounding of sums of ~50 log-probs
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[0]["rewards/chosen"] == pytest.approx(0, abs=1e-4)
    assert records[-1]["loss"] < records[0]["loss"] - 0.05  # lr 1e-3: it learns to prefer the chosen answers
    assert records[-1]["rewards/margins"] > 0
    # the cached reference log-probs: the seeded init (seed 42) through transformers' Qwen3, by hand
    (cache,) = glob.glob(os.path.join(argv[argv.index("--cache_dir") + 1], "*.dpo_ref.*.pt"))
    cached = torch.load(cache)["log_probs"]  # beside its shape and checksum
    ds = DPODataset(data, tokenizer, max_length=64, cache_dir=os.path.dirname(cache))
    setup_seed(42)
    hf = hf_model(MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), **TINY_CONFIG)))
    with torch.no_grad():
        for i in (0, 1, 7):
            expected = hand_log_probs(hf, ds[i][0], ds[i][1])
            assert torch.allclose(cached[i].double(), expected, atol=1e-3), (i, cached[i], expected)


def test_dp2_x_pp2_equals_the_single_process(single_run, tmp_path):
    """DPO's own parts under sharding: each dp rank computes its share of the reference log-probs, through the
    pipeline's forward-only schedule, and they ride with the rows into pp's micro-batches. The log-probs of
    vocab-sharded logits (tp) are KTO's code: tests/test_kto.py's tp2 layout; the loop and wrap in every layout:
    tests/test_layouts.py."""
    argv, records, data = single_run
    run = run_args(tmp_path, "layout", data, dp=2, extra=["--pp", "2"])
    proc = forked(SCRIPT, nproc=4, args=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics_of(run)
    assert [r["step"] for r in got] == [r["step"] for r in records]
    for a, b in zip(got, records):  # other reduction orders (DDP, pp's stages): fp32 rounding
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        for name in REWARDS:
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), (a["step"], name, a[name], b[name])


def test_resume_after_a_kill_continues_with_the_same_losses(single_run, tmp_path):
    argv, records, data = single_run
    run = run_args(tmp_path, "killed", data, extra=["--save_interval", "1"])
    kill_at_step("train_dpo", run, 3)
    for path in glob.glob(os.path.join(run[run.index("--cache_dir") + 1], "*.dpo_ref.*.pt")):
        os.remove(path)  # the resumed run computes the reference again: from the reference weights, not the policy
    resume_run(SCRIPT, run, 3)
    got = metrics_of(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, records):  # same process count, same reduction order
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["rewards/margins"] == pytest.approx(b["rewards/margins"],
                                                                                            abs=1e-6), (a, b)


def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    rows = pair_rows(8)
    del rows[4]["rejected"]
    data = write_rows(tmp_path / "bad.jsonl", rows)
    code, err = run_in_process(monkeypatch, capsys, train_dpo, run_args(tmp_path, "bad", data))
    assert code == 2 and err[-1].startswith("error: ") and err[-1].endswith("bad.jsonl:5: no 'rejected' field"), err
    code, err = run_in_process(monkeypatch, capsys, train_dpo, run_args(tmp_path, "beta", data) + ["--beta", "0"])
    assert code == 2 and err == ["error: --beta must be > 0 (MiniMind uses 0.15), got 0.0"], err


def test_a_second_round_resumes_against_its_own_reference_after_overwriting_it(single_run, tmp_path, monkeypatch,
                                                                                capsys):
    """DPO round 2 from its own output (--from_weight dpo, saving dpo): the weights saved at step 4 overwrite the
    reference file before a SIGKILL; the resume keeps the run's reference (its cached log-probs, by content) and
    steps 5-6 equal the uninterrupted run's. Without that cache it refuses in one line; another --beta too."""
    _, _, data = single_run
    torch.manual_seed(7)
    start = MiniMindForCausalLM(MiniMindConfig(**TINY_CONFIG))
    runs = {}
    for name in ("straight", "killed"):
        save_weights_file(start.state_dict(), start.config, str(tmp_path / name / "dpo_64.pth"))
        runs[name] = run_args(tmp_path, name, data, extra=["--from_weight", "dpo", "--save_weights_every", "2",
                                                           "--save_interval", "1"])
    with open(tmp_path / "killed" / "dpo_64.pth", "rb") as f:
        start_sha = hashlib.sha256(f.read()).hexdigest()
    straight = forked(SCRIPT, runs["straight"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    env = {"MINIMIND_TEST_STAGE": "train_dpo", "MINIMIND_TEST_KILL_AT_STEP": "4"}
    killed = forked("tests/helpers/fault_entry.py", args=runs["killed"], timeout=300, env=env)
    assert killed.returncode != 0 and "SIGKILL rank 0 at step 4" in killed.stdout + killed.stderr
    weights = str(tmp_path / "killed" / "dpo_64.pth")
    assert not torch.equal(torch.load(weights)["lm_head.weight"], start.state_dict()["lm_head.weight"])  # overwritten
    resumed = forked(SCRIPT, [*runs["killed"], "--from_resume", "1"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--ref_weight {weights} has changed since this run started" in resumed.stdout
    got, want = metrics_of(runs["killed"]), metrics_of(runs["straight"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):  # same process count, same reduction order
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])

    code, err = run_in_process(monkeypatch, capsys, train_dpo, [*runs["killed"], "--from_resume", "1", "--beta", "0.3"])
    assert code == 2 and len(err) == 1 and "step_6 was saved with --beta 0.15, this run has --beta 0.3; pass --beta " \
                                           "0.15 to continue it, or --from_resume 0 to start over" in err[0], err
    (cache,) = glob.glob(os.path.join(runs["killed"][runs["killed"].index("--cache_dir") + 1], "*.dpo_ref.*.pt"))
    os.remove(cache)
    code, err = run_in_process(monkeypatch, capsys, train_dpo, [*runs["killed"], "--from_resume", "1"])
    assert code == 2 and err == [
        f"error: --ref_weight {weights} no longer holds this run's reference (its content has changed since the run "
        f"started with sha256 {start_sha[:12]}: a save of this run over it?) and the run's reference log-probs "
        f"{cache} are gone; pass --ref_weight with the "
        "starting weights, or --from_resume 0 to start over"], err


def test_a_damaged_reference_cache_is_computed_again_with_a_note(single_run, tmp_path):
    """The single run's cache cut in half: a run on it says so, computes the log-probs again and trains the same."""
    argv, records, data = single_run
    cache_dir = argv[argv.index("--cache_dir") + 1]
    (cache,) = glob.glob(os.path.join(cache_dir, "*.dpo_ref.*.pt"))
    size = os.path.getsize(cache)
    with open(cache, "r+b") as f:
        f.truncate(size // 2)
    run = [*run_args(tmp_path, "again", data), "--cache_dir", cache_dir, "--max_steps", "2"]
    proc = forked(SCRIPT, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"note: the reference log-probs cache {cache} is damaged (unreadable: " in proc.stdout
    assert os.path.getsize(cache) == size
    got = metrics_of(run)
    assert [r["loss"] for r in got] == [r["loss"] for r in records[:2]]  # the same process, the same values


# ----------------------------------------------------------------------------- the DPO family (--loss_type)
# two pairs, the policy away from the reference: summed log-probs, and target tokens per row (chosen, rejected)
PC, PR, RC, RR = (-12.0, -30.0), (-15.0, -20.0), (-13.0, -28.0), (-14.0, -22.0)
LENGTHS = ((4, 5), (10, 8))


def logsig(x):
    return -math.log1p(math.exp(-x))


def hand_losses(loss_type, beta, smoothing=0.0, gamma=0.5):
    """Each variant's per-pair loss in float64, written out from the papers / TRL (not the code under test)."""
    out = []
    for k in range(2):
        (lc, lr), (pc, pr, rc, rr) = LENGTHS[k], (PC[k], PR[k], RC[k], RR[k])
        if loss_type in ("ipo", "simpo", "orpo"):  # per-token log-probs
            pc, pr, rc, rr = pc / lc, pr / lr, rc / lc, rr / lr
        h = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":
            out.append(-logsig(beta * h) * (1 - smoothing) - logsig(-beta * h) * smoothing)
        elif loss_type == "robust":
            out.append((-logsig(beta * h) * (1 - smoothing) + logsig(-beta * h) * smoothing) / (1 - 2 * smoothing))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif loss_type == "simpo":
            z = beta * pc - beta * pr - gamma
            out.append(-logsig(z) * (1 - smoothing) - logsig(-z) * smoothing)
        else:  # orpo: SFT's NLL of the chosen answer minus beta x log sigmoid of the log odds ratio
            odds = (pc - math.log(1 - math.exp(pc))) - (pr - math.log(1 - math.exp(pr)))
            out.append(-pc - beta * logsig(odds))
    return out


@pytest.mark.parametrize("loss_type,beta,smoothing", [
    ("sigmoid", 0.15, 0.0), ("sigmoid", 0.3, 0.2), ("robust", 0.1, 0.1), ("hinge", 0.1, 0.0), ("hinge", 0.5, 0.0),
    ("ipo", 0.1, 0.0), ("simpo", 2.0, 0.0), ("simpo", 2.5, 0.1), ("orpo", 0.1, 0.0)])
def test_each_loss_type_equals_its_formula_by_hand(loss_type, beta, smoothing):
    objective = DPOObjective(beta, loss_type, smoothing, 0.5)
    log_probs = torch.tensor([PC[0], PR[0], PC[1], PR[1]], dtype=torch.float64)
    targets = torch.full((4, 12), -100)
    for row, n in enumerate((LENGTHS[0][0], LENGTHS[0][1], LENGTHS[1][0], LENGTHS[1][1])):
        targets[row, 12 - n:] = 7  # n target tokens, after a prompt
    reference = torch.tensor([[RC[0], RR[0]], [RC[1], RR[1]]], dtype=torch.float64).reshape(-1, 1)
    extra = (reference,) if objective.loss_type.needs_reference else ()
    loss_sum, stats = objective.pair_losses(log_probs, targets, extra)
    expected = hand_losses(loss_type, beta, smoothing)
    # fp32 arithmetic on values of size ~30: a few ulp
    assert loss_sum.item() == pytest.approx(sum(expected), rel=1e-5, abs=1e-6)
    assert loss_sum.item() > 0 and expected[0] != expected[1]
    record = objective.record({k: float(v) for k, v in stats.items()}, 2)
    if loss_type == "orpo":
        assert record["nll_loss"] == pytest.approx(-(PC[0] / 4 + PC[1] / 10) / 2, rel=1e-6)


def test_the_loss_table_declares_reference_and_defaults():
    from trainer.stages.dpo_losses import LOSSES
    assert sorted(LOSSES) == ["hinge", "ipo", "orpo", "robust", "sigmoid", "simpo"]
    assert [name for name, row in LOSSES.items() if not row.needs_reference] == ["simpo", "orpo"]
    assert LOSSES["sigmoid"].beta == BETA and LOSSES["simpo"].beta == 2.0


def test_a_reference_free_loss_skips_the_reference_and_a_reference_flag_is_refused(single_run, tmp_path, monkeypatch,
                                                                                    capsys):
    """simpo trains without a reference pass or cache; --ref_weight with it is one line, exit 2."""
    _, _, data = single_run
    run = run_args(tmp_path, "simpo", data, extra=["--loss_type", "simpo", "--max_steps", "3"])
    proc = forked(SCRIPT, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference log-probs" not in proc.stdout and "reference none needed" in proc.stdout
    assert not glob.glob(os.path.join(run[run.index("--cache_dir") + 1], "*.dpo_ref.*"))
    records = metrics_of(run)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    code, err = run_in_process(monkeypatch, capsys, train_dpo, [*run, "--ref_weight", "none"])
    assert code == 2 and err == ["error: --loss_type simpo uses no reference model; leave out --ref_weight none (or "
                                 "pick a loss with one: sigmoid, ipo, hinge, robust)"], err
    code, err = run_in_process(monkeypatch, capsys, train_dpo,
                               [*run, "--loss_type", "hinge", "--label_smoothing", "0.1"])
    assert code == 2 and err == ["error: --label_smoothing applies to --loss_type sigmoid, robust or simpo, not "
                                 "hinge; leave it out"], err


def test_orpo_under_a_pipeline_equals_one_process(single_run, tmp_path):
    """A reference-free loss has no extras to cut into micro-batches: pp 2 (2 ranks) against one process."""
    _, _, data = single_run
    extra = ["--loss_type", "orpo", "--max_steps", "3"]
    one, two = run_args(tmp_path, "orpo1", data, extra=extra), run_args(tmp_path, "orpo2", data, extra=[*extra,
                                                                                                        "--pp", "2"])
    for argv, nproc in ((one, 1), (two, 2)):
        proc = forked(SCRIPT, nproc=nproc, args=argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(metrics_of(two), metrics_of(one), strict=True):  # pp's micro-batches: fp32 rounding
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["nll_loss"] == pytest.approx(b["nll_loss"], rel=1e-5)


def shared_prompt_pairs():
    """Pairs that share their prompt (single-turn), share a labelled first turn (multi-turn: the shared prefix ends
    before it), or differ from their first message on; prompts and answers of mixed lengths, one cut at 64."""
    def chat(*turns):
        return [{"role": role, "content": text} for role, text in zip(("user", "assistant") * 3, turns)]
    long_answer = " ".join(f"word{i}" for i in range(40))
    return [
        {"chosen": chat("What is 2 + 2?", "4."), "rejected": chat("What is 2 + 2?", "5, I believe, or maybe 6.")},
        {"chosen": chat("Name a colour, any colour you like, as long as it is one.", long_answer),
         "rejected": chat("Name a colour, any colour you like, as long as it is one.", "Red.")},
        {"chosen": chat("Hi", "Hello!", "And a fruit?", "Apple."),
         "rejected": chat("Hi", "Hello!", "And a fruit?", "A stone, probably.")},
        {"chosen": chat("Say yes.", "Yes."), "rejected": chat("Say no, then.", "No.")},
    ]


def test_shared_prompt_rows_match_transformers_and_the_two_row_layout(tmp_path, tokenizer):
    """One row per pair (its prompt run once, the rejected answer branching off it: trainer/core/shared_prefix.py):
    the loss and gradients equal the float64 formula over transformers' Qwen3 on the two separate rows, and the
    two-row layout's within fp32 rounding; the reference pass gives the same sums; fewer positions run."""
    ds = DPODataset(write_rows(tmp_path / "d.jsonl", shared_prompt_pairs()), tokenizer, max_length=64,
                    cache_dir=tmp_path / "c")
    n = len(ds)
    input_ids, labels = (torch.stack([ds[i][k] for i in range(n)]) for k in (0, 1))
    policy, hf_policy, reference, rows, ref, pc, pr, expected = formula_over_transformers(input_ids, labels, tokenizer)
    hf_grads = dict(hf_policy.named_parameters())

    losses, grads = {}, {}
    for shared in (True, False):
        objective = DPOObjective(BETA, shared_prompt=shared, pad_token_id=tokenizer.pad_token_id, row_multiple=8,
                                 row_capacity=128)  # two pairs' documents in a row where they fit
        x, y, positions, extra = objective.unpack((input_ids, labels, ref.float()))
        assert objective.count(y, extra) == n
        policy.zero_grad()
        loss, _, _ = objective.loss(policy, x, step_targets(y), positions, extra, num_items=n)
        loss.backward()
        losses[shared], grads[shared] = loss.item(), {k: p.grad.clone() for k, p in policy.named_parameters()}
        if shared:
            assert x.numel() < rows.numel() and len(x) < n  # each prompt once, pairs packed
            with torch.no_grad():  # the reference pass lays pairs out as training does
                got = objective.pair_log_probs(policy, input_ids, labels, "cpu")
            assert torch.allclose(got.double(), torch.stack([pc, pr], 1).detach(), atol=1e-4)
    # fp32 model against a float64 formula over fp32 logits: sums of ~40 log-probs of size ~9, rounding ~1e-5
    assert losses[True] == pytest.approx(expected.item(), abs=1e-5)
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    for name, grad in grads[True].items():
        scale = hf_grads[name].grad.abs().max().item()
        assert (grad - hf_grads[name].grad.float()).abs().max().item() <= 1e-4 * scale + 1e-9, name
        assert (grad - grads[False][name]).abs().max().item() <= 1e-4 * scale + 1e-9, name
