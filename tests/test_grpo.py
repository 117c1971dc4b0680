"""GRPO (trainer/rl/grpo.py, policy_loss.py, rows.py, train_grpo.py): advantages and every loss type's gradient
against a REINFORCE surrogate and, away from ratio 1, a float64 hand computation written out here; what must not
count (prompt, padding, after EOS), rollout reuse, the layouts against one process on a real local rollout server,
exact resume after a kill, a toy task learnt, bad input and failing reward functions."""
import glob
import math
import os
import sys

import pytest
import torch

from model.errors import ConfigError
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, kill_at_step, resume_run, run_in_process
from tests.helpers.rollout_server import RolloutServer, metrics_of, served_run
from trainer import train_grpo
from trainer.core.batches import step_targets
from trainer.core.loop import epoch_batches, train_step
from trainer.plan.resolve import resolve
from trainer.rl.grpo import GRPOPlan
from trainer.rl.policy_loss import group_advantages, k3_kl, leave_one_out_advantages

REWARD_FNS = os.path.join(ROOT, "tests", "helpers", "reward_fns.py")
TEMPERATURE = 0.8


def grpo_flags(tmp_path, data, *extra):
    out = str(tmp_path / "out")
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "48", "--max_gen_len", "10",
            "--num_generations", "4", "--batch_size", "2", "--accumulation_steps", "2", "--learning_rate", "1e-3",
            "--reward", "none", "--reward_fn", f"{REWARD_FNS}:distinct_chars", "--temperature", str(TEMPERATURE),
            "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt"), "--cache_dir", os.path.join(out, "c"),
            *extra]


def in_process_trainer(monkeypatch, tmp_path, *extra):
    """A Trainer built as train_grpo.py builds it (one process), and the step's loader micro-batches."""
    os.makedirs(tmp_path, exist_ok=True)
    data = demo_slice(tmp_path, "rlaif", 40)
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", *grpo_flags(tmp_path, data, *extra)])
    trainer, train_ds = train_grpo.build(train_grpo.grpo_args())
    batches = epoch_batches(trainer, train_ds, 0)
    return trainer, [next(batches) for _ in range(trainer.plan.data.num_microbatches)]


def objective_loss(trainer, prepared):
    """The step's loss as train_step forms it (the sum of each micro-batch's share) and the policy's gradient."""
    objective, model = trainer.objective, trainer.model_parts[0]
    unpacked = [objective.unpack(batch) for batch in prepared]
    num_items = sum(objective.count(labels, extra) for _, labels, _, extra in unpacked)
    total, stats = 0.0, []
    for ids, labels, positions, extra in unpacked:
        loss, _, micro_stats = objective.loss(model, ids, step_targets(labels), positions, extra, num_items)
        total, stats = total + loss, stats + [micro_stats]
    grads = torch.autograd.grad(total, list(model.parameters()))
    return total.detach(), grads, stats


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    advantages, std = group_advantages(rewards, 4)
    population_std = (sum((r - 3.0) ** 2 for r in (1, 2, 3, 6)) / 4) ** 0.5
    assert advantages[:4].tolist() == pytest.approx([(r - 3.0) / (population_std + 1e-4) for r in (1, 2, 3, 6)])
    assert advantages[4:].tolist() == [0.0] * 4 and std.tolist() == [pytest.approx(population_std)] * 4 + [0.0] * 4
    single, single_std = group_advantages(torch.tensor([0.3, -2.0]), 1)  # --num_generations 1: nothing to compare
    assert single.tolist() == [0.0, 0.0] and single_std.tolist() == [0.0, 0.0]


def test_k3_kl_value_and_gradient_by_hand():
    """k3 = e^d - d - 1 with d = ref - log pi, and d k3 / d log pi = 1 - e^d, written out per token in float64."""
    reference = torch.tensor([-1.0, -2.5, -0.2, -4.0], dtype=torch.float64)
    log_probs = torch.tensor([-1.3, -2.0, -0.2, -3.1], dtype=torch.float64, requires_grad=True)
    kl = k3_kl(reference, log_probs)
    deltas = [-1.0 + 1.3, -2.5 + 2.0, 0.0, -4.0 + 3.1]
    assert kl.tolist() == pytest.approx([math.exp(d) - d - 1 for d in deltas], abs=1e-15)
    (gradient,) = torch.autograd.grad(kl.sum(), log_probs)
    assert gradient.tolist() == pytest.approx([1 - math.exp(d) for d in deltas], abs=1e-15)


def test_leave_one_out_advantages_by_hand():
    """RLOO: each reward minus the mean of its group's other rewards."""
    advantages, _ = leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0]), 4)
    assert advantages.tolist() == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0, 0, 0, 0, 0], abs=1e-6)


def test_equal_rewards_give_zero_advantages_loss_and_gradient(monkeypatch, tmp_path):
    """A constant reward: every advantage 0, so the policy term and its gradient vanish; the KL to the reference (the
    starting weights, loaded apart) is 0 with a zero gradient at the first step. train_step logs them so."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--reward_fn", f"{REWARD_FNS}:constant",
                                                "--reward_weights", "0,2", "--beta", "0.1", "--loss_type", "grpo")
    prepared = trainer.objective.prepare(trainer, micro_batches)
    assert all((extra[0] == 0).all() for _, _, extra in prepared)
    loss, grads, _ = objective_loss(trainer, prepared)
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads)
    metrics = train_step(trainer, micro_batches)
    record = trainer.objective.record({k: float(v) for k, v in metrics["stats"].items()}, metrics["num_items"])
    assert metrics["ce"].item() == 0.0
    assert record["frac_reward_zero_std"] == 1.0 and record["reward_std"] == 0.0 and record["kl"] == 0.0
    assert record["reward"] == 2 * 0.25  # distinct_chars x 0, constant 0.25 x 2
    assert record["rewards/constant/mean"] == 0.25


def surrogate(model, prepared, loss_type, max_gen_len):
    """REINFORCE written out: the gradient of -sum A_i log pi(t) over completion tokens at the sampling temperature,
    with the loss type's normaliser (TRL's), the advantages recomputed from the logged rewards. Its value: cispo's
    -A log pi; the ratio losses' -A exp(log pi - sg(log pi)) = -A (the ratio is 1, its gradient that of log pi)."""
    terms, tokens, rows = [], 0, 0
    for ids, labels, extra in prepared:
        rewards = extra[1][:, 0].view(-1, 4).double()
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True)
                                                                  + 1e-4)).view(-1, 1)
        logits = model(ids).logits.double()[:, :-1] / TEMPERATURE
        targets = labels[:, 1:]
        mask = (targets != -100).double()
        log_probs = torch.log_softmax(logits, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0] * mask
        weight = log_probs if loss_type == "cispo" else torch.exp(log_probs - log_probs.detach()) * mask
        terms.append((-advantages * weight, mask))
        tokens, rows = tokens + mask.sum(), rows + ids.shape[0]
    if loss_type == "grpo":
        return sum(((t.sum(1) / m.sum(1)).sum() for t, m in terms)) / rows
    if loss_type == "bnpo":
        return sum(t.sum() / m.sum() for t, m in terms) / len(terms)
    if loss_type == "dr_grpo":
        return sum(t.sum() for t, _ in terms) / (rows * max_gen_len)
    return sum(t.sum() for t, _ in terms) / tokens  # dapo, cispo


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo", "cispo"])
def test_first_update_is_the_reinforce_gradient(monkeypatch, tmp_path, loss_type):
    """On a fresh rollout the ratio is exactly 1 (nothing clipped) and the loss and gradient are REINFORCE's with the
    loss type's normaliser; the KL term (the reference equals the policy) adds neither value nor gradient."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--loss_type", loss_type, "--beta", "0.1")
    prepared = trainer.objective.prepare(trainer, micro_batches)
    loss, grads, stats = objective_loss(trainer, prepared)
    model = trainer.model_parts[0]
    expected = surrogate(model, prepared, loss_type, 10)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    assert any(extra[0].abs().max() > 0.5 for _, _, extra in prepared)  # the rewards differ within groups
    # cispo's value holds the log-probs themselves: fp32 log-softmax over 6400 logits, |log p| ~ 9, is ~1e-6 off per
    # token (the ratio losses' values hold advantages only)
    assert loss.item() == pytest.approx(expected.item(), abs=2e-5 if loss_type == "cispo" else 1e-6)
    for g, e in zip(grads, expected_grads):  # fp32 against float64 log-softmax of the same fp32 logits
        assert (g - e).abs().max().item() <= 1e-6, (loss_type, (g - e).abs().max().item())
    clipped = sum(sum(v.item() for k, v in s.items() if "clip" in k) for s in stats)
    assert clipped == 0 and sum(s["kl_sum"].item() for s in stats) == 0.0


def hand_loss(logits, prepared, old, reference, loss_type, epsilon, epsilon_high, beta, max_gen_len):
    """The step's loss written out in float64 from the logits (N, L, V) of each micro-batch: ratio r = pi / pi_old per
    token (gspo: exp of the token mean of log r per completion; rloo: exp of its sum), the clipped surrogate
    -min(r A, clip(r, 1 - eps, 1 + eps_high) A) (cispo: -sg(min(r, eps_high)) A log pi), plus beta (e^d - d - 1),
    d = ref - log pi, under the loss type's normaliser; A recomputed from the logged rewards (rloo: minus the mean of
    the group's others). Also the clipped counts (low: r < 1 - eps with A < 0; high: r > 1 + eps_high with A > 0) over
    tokens, or over completions for a sequence ratio."""
    terms, tokens, rows, low, high = [], 0, 0, 0, 0
    for (ids, labels, extra), z, o, ref in zip(prepared, logits, old, reference):
        rewards = extra.row_stats[:, 0].view(-1, 4).double()
        if loss_type == "rloo":
            advantages = (rewards - (rewards.sum(1, keepdim=True) - rewards) / 3).view(-1, 1)
        else:
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True)
                                                                      + 1e-4)).view(-1, 1)
        targets = step_targets(labels)
        mask = (targets != -100).double()
        log_probs = torch.log_softmax(z.double() / TEMPERATURE, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0]
        log_ratio = (log_probs - o.double()) * mask
        if loss_type == "gspo":
            log_ratio = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        elif loss_type == "rloo":
            log_ratio = log_ratio.sum(1, keepdim=True)
        ratio = torch.exp(log_ratio)
        unit = mask if ratio.shape[1] > 1 else 1.0
        low += float((((ratio < 1 - epsilon) & (advantages < 0)) * unit).sum())
        high += float((((ratio > 1 + epsilon_high) & (advantages > 0)) * unit).sum())
        if loss_type == "cispo":
            term = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * log_probs
        else:
            term = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages)
        d = ref.double() - log_probs
        terms.append(((term + beta * (torch.exp(d) - d - 1)) * mask, mask))
        tokens, rows = tokens + mask.sum(), rows + ids.shape[0]
    if loss_type in ("grpo", "gspo", "rloo"):
        loss = sum(((t.sum(1) / m.sum(1)).sum() for t, m in terms)) / rows
    elif loss_type == "bnpo":
        loss = sum(t.sum() / m.sum() for t, m in terms) / len(terms)
    elif loss_type == "dr_grpo":
        loss = sum(t.sum() for t, _ in terms) / (rows * max_gen_len)
    else:  # dapo, cispo
        loss = sum(t.sum() for t, _ in terms) / tokens
    return loss, low, high, (rows if loss_type in ("gspo", "rloo") else float(tokens))


@pytest.mark.parametrize("loss_type,epsilon,epsilon_high", [
    ("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28), ("dr_grpo", 0.2, 0.2), ("bnpo", 0.2, 0.2), ("cispo", 0.2, 1.1),
    ("gspo", 3e-4, 4e-4), ("rloo", 0.2, 0.2)])
def test_the_loss_away_from_ratio_one_against_the_reference_by_hand(monkeypatch, tmp_path, loss_type, epsilon,
                                                                    epsilon_high):
    """Old log-probs moved off the policy's by up to +-0.4 (ratios 0.67 to 1.5: both clip sides act) and a reference
    moved off it by up to +-0.5: the loss and its gradient in the logits equal hand_loss's float64 ones, and the
    clip counts equal the tokens (gspo, rloo: completions) the hand ratio puts outside the clip range."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--loss_type", loss_type, "--beta", "0.1",
                                                "--num_iterations", "2", "--epsilon", str(epsilon), "--epsilon_high",
                                                str(epsilon_high))
    objective, model = trainer.objective, trainer.model_parts[0]
    prepared = objective.prepare(trainer, micro_batches)
    generator = torch.Generator().manual_seed(1)
    logits, old, reference, moved = [], [], [], []
    for ids, labels, extra in prepared:
        with torch.no_grad():
            logits.append(model(ids).logits.requires_grad_())
        mask = step_targets(labels) != -100
        shift = (torch.rand(mask.shape, generator=generator) * 0.8 - 0.4) * mask
        old.append(extra.old_log_probs + shift)
        reference.append(extra.reference + (torch.rand(mask.shape, generator=generator) - 0.5) * mask)
        moved.append((ids, labels, extra._replace(old_log_probs=old[-1], reference=reference[-1])))
    unpacked = [objective.unpack(batch) for batch in moved]
    num_items = sum(objective.count(labels, extra) for _, labels, _, extra in unpacked)
    loss, totals = 0.0, {}
    for z, (_, labels, extra) in zip(logits, moved):  # each completion's own row (unpack may share its prompt)
        part, stats = objective.policy_loss(z, step_targets(labels), extra, num_items)
        loss = loss + part
        totals = {k: totals.get(k, 0.0) + float(v) for k, v in stats.items()}
    grads = torch.autograd.grad(loss, logits)
    leaves = [z.detach().double().requires_grad_() for z in logits]
    expected, low, high, units = hand_loss(leaves, moved, old, reference, loss_type, epsilon, epsilon_high, 0.1, 10)
    expected_grads = torch.autograd.grad(expected, leaves)
    # fp32 log-softmax over 6400 logits is ~1e-6 off per token; cispo's terms hold log pi itself (|log pi| ~ 9), whose
    # errors do not cancel as the advantages' signs do (as test_first_update_is_the_reinforce_gradient)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=2e-5 if loss_type == "cispo" else 1e-6)
    for g, e in zip(grads, expected_grads):  # each logit's gradient is ~p / tokens: fp32 rounding of that
        assert (g.double() - e).abs().max().item() <= 1e-7 + 1e-4 * e.abs().max().item()
    record = objective.record(totals, num_items)
    if loss_type != "cispo":  # TRL's clip_ratio/*: the share of tokens (gspo, rloo: of completions) clipped
        assert low > 0 and high > 0  # both sides of the clip were exercised
        assert (totals["clip_low_sum"], totals["clip_high_sum"], totals["clip_region_sum"]) == (low, high, low + high)
        assert record["clip_ratio/low_mean"] == pytest.approx(low / units, abs=1e-12)
        assert record["clip_ratio/region_mean"] == pytest.approx((low + high) / units, abs=1e-12)


def test_prompt_padding_and_tokens_after_eos_change_neither_loss_nor_gradient(monkeypatch, tmp_path):
    """Rows with other tokens where nothing is scored (the padding after each completion's EOS) and with more padding
    columns give the same loss and gradient: only completion tokens are targets, and causal attention keeps later
    positions out of earlier ones."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--loss_type", "dapo", "--beta", "0")
    prepared = trainer.objective.prepare(trainer, micro_batches)
    loss, grads, _ = objective_loss(trainer, prepared)
    generator = torch.Generator().manual_seed(0)
    changed = []
    for ids, labels, extra in prepared:
        ids, labels = ids.clone(), labels.clone()
        after = torch.ones_like(labels, dtype=torch.bool)
        for row in range(ids.shape[0]):
            last = int((labels[row] != -100).nonzero().max())
            after[row, :last + 1] = False
        ids[after] = torch.randint(3, 6400, (int(after.sum()),), generator=generator)
        ids = torch.cat([ids, torch.randint(3, 6400, (ids.shape[0], 5), generator=generator)], 1)
        labels = torch.cat([labels, torch.full((ids.shape[0], 5), -100)], 1)
        changed.append((ids, labels, extra))
    assert any((ids[:, :-5] != p[0]).any() for (ids, _, _), p in zip(changed, prepared))  # tokens after EOS changed
    loss2, grads2, _ = objective_loss(trainer, changed)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-7)
    for g, g2 in zip(grads, grads2):  # other matmul shapes only: fp32 rounding
        assert (g - g2).abs().max().item() <= 1e-7


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "rloo"])
def test_a_reused_rollout_starts_at_ratio_one_and_then_clips(monkeypatch, tmp_path, loss_type):
    """--num_iterations 2: the first step on a rollout loses exactly what --num_iterations 1 loses (its old log-probs,
    a forward before the update, equal the policy's: ratio 1); the second trains on the same rollout with moved
    weights, so the ratio leaves [1 - epsilon, 1 + epsilon] for some tokens (gspo, rloo: completions)."""
    flags = ("--loss_type", loss_type, "--beta", "0", "--learning_rate", "3e-2")
    first = {}
    for iterations in ("1", "2"):
        trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path / iterations, *flags, "--num_iterations",
                                                    iterations)
        metrics = [train_step(trainer, micro_batches) for _ in range(2)]
        first[iterations] = metrics[0]["ce"].item()
        records = [trainer.objective.record({k: float(v) for k, v in m["stats"].items()}, m["num_items"])
                   for m in metrics]
        assert records[0]["clip_ratio/region_mean"] == 0.0
    assert first["1"] == first["2"]
    assert records[1]["clip_ratio/region_mean"] > 0.1 and records[1]["reward"] == records[0]["reward"]


# ----------------------------------------------------------------------------- end to end
SCRIPT = "trainer/train_grpo.py"
TIMING = ("tokens_per_sec", "mfu", "elapsed_s", "peak_mem_gb", "peak_mem_gb_per_rank", "rollout/tokens_per_sec",
          "rollout/time_share")


def run_flags(tmp_path, name, data, dp=1, extra=()):
    """4 prompts x 2 completions per step (2 micro-batches), 3 steps, each rollout trained twice."""
    out = str(tmp_path / name)
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "32", "--max_gen_len", "8",
            "--num_generations", "2", "--batch_size", str(2 // dp), "--accumulation_steps", "2", "--max_steps", "3",
            "--learning_rate", "1e-3", "--loss_type", "grpo", "--num_iterations", "2", "--reward", "none",
            "--reward_fn", f"{REWARD_FNS}:distinct_chars", "--save_dir", out, "--checkpoint_dir", f"{out}/ckpt",
            "--cache_dir", f"{out}/c", "--metrics_file", f"{out}/metrics.jsonl", "--log_interval", "1", *extra]


def test_the_console_says_reused_on_the_steps_that_generate_nothing(tmp_path):
    """--num_iterations 2: steps 1 and 3 roll out, step 2 trains on step 1's rollout again; only step 2's line and
    record say so (rollout/reused)."""
    argv = run_flags(tmp_path, "console", demo_slice(tmp_path, "rlaif", 40))
    proc = forked(SCRIPT, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [r["rollout/reused"] for r in metrics_of(argv)] == [False, True, False]
    assert [line.endswith("| rollout reused") for line in lines] == [False, True, False], lines
    assert all(line.endswith("of the time") for line in lines[::2]), lines


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A local rollout server, the prompts, and the single process's records with its completions."""
    server = RolloutServer()
    data, records = served_run(SCRIPT, run_flags, tmp_path_factory.mktemp("grpo_served"), server)
    yield server, data, records
    server.close()


def test_tp2_equals_the_single_process(served, tmp_path):
    """The same served completions trained under tensor parallel: the same rewards, losses, KL and clipping as one
    process (the tempered log-probs of vocab-sharded logits, the reference and the old-policy forwards under tp).
    GRPO holds nothing of its own across dp ranks (a prompt's group is on one rank): DDP and ZeRO-3 are the loop's
    (tests/test_layouts.py), generation on FSDP2-sharded weights test_in_process_rollouts_under_zero3_equal_ddp; an
    RL stage's extras through pp's micro-batches: tests/test_ppo.py's pp2."""
    server, data, records = served
    requests = len(server.requests)
    _, got = served_run(SCRIPT, run_flags, tmp_path, server, data, "tp2")
    assert len(server.requests) - requests == 2 * 2  # 2 rollouts x 2 micro-batches, one request per replica
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1]["clip_ratio/region_mean"] > 0  # the reused rollout's step clips: the old log-probs are tested
    for a, b in zip(got, records):  # fp32 reductions in other orders; the loss sums ~60 terms of size ~1
        for name in ("loss", "kl", "entropy", "clip_ratio/region_mean", "reward", "reward_std",
                     "completions/mean_length"):
            assert a[name] == pytest.approx(b[name], abs=2e-6), (a["step"], name, a[name], b[name])


def test_in_process_rollouts_under_zero3_equal_ddp(tmp_path):
    """Generation on FSDP2-sharded weights (gathered for the rollout) samples what DDP's whole model samples: the same
    completions, so the same rewards and losses (ranks that stop at different steps: tests/test_rollout.py)."""
    data = demo_slice(tmp_path, "rlaif", 40)
    runs = {}
    for name, layout in (("ddp", []), ("zero3", ["--zero_stage", "3"])):
        argv = run_flags(tmp_path, name, data, dp=2, extra=["--max_gen_len", "24", *layout])
        proc = forked(SCRIPT, argv, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics_of(argv)
    for a, b in zip(runs["zero3"], runs["ddp"]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-6)


def test_in_process_rollouts_under_expert_parallel_equal_ddp(tmp_path):
    """A MoE policy with its experts over 2 ranks (--ep 2: every decoding step is an all-to-all) samples what DDP's
    whole MoE model samples: the same completions and lengths, so the same rewards, and losses to fp32 rounding (the
    experts' rows summed in another order). Ranks that finish at different steps: tests/test_rollout.py."""
    data = demo_slice(tmp_path, "rlaif", 40)
    moe = ["--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2", "--max_gen_len", "24"]
    runs = {}
    for name, layout in (("ddp", []), ("ep2", ["--ep", "2"])):
        argv = run_flags(tmp_path, name, data, dp=2, extra=[*moe, *layout])
        proc = forked(SCRIPT, argv, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics_of(argv)
    assert [r["step"] for r in runs["ep2"]] == [r["step"] for r in runs["ddp"]] == [1, 2, 3]
    for a, b in zip(runs["ep2"], runs["ddp"]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-6)


def test_resume_after_a_kill_repeats_the_rollouts_and_losses(tmp_path):
    """Killed after step 3, between the two steps on one rollout: the resumed run restores that rollout and rolls
    out the next ones with the same seeds, so every later record equals the uninterrupted run's."""
    data = demo_slice(tmp_path, "rlaif", 40)
    extra = ["--max_steps", "6", "--beta", "0.1", "--save_interval", "1"]
    straight = run_flags(tmp_path, "straight", data, extra=extra)
    assert forked(SCRIPT, straight).returncode == 0
    run = run_flags(tmp_path, "killed", data, extra=extra)
    kill_at_step("train_grpo", run, 3)
    saved = {os.path.basename(os.path.dirname(path)) for path in
             glob.glob(os.path.join(run[run.index("--checkpoint_dir") + 1], "*", "step_*", "objective_0.pt"))}
    assert saved == {"step_1", "step_3"}  # only where the next step trains on the same rollout
    resume_run(SCRIPT, run, 3)
    got, expected = metrics_of(run), metrics_of(straight)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, 7))  # zip compares all 6
    for a, b in zip(got, expected):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_a_toy_task_is_learnt(tmp_path):
    """A verifiable reward, the share of digits in a completion: a 2-layer model from scratch raises its mean reward
    by far more than 0.3 within 60 steps."""
    data = demo_slice(tmp_path, "rlaif", 400)
    out = str(tmp_path / "toy")
    argv = [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "64", "--max_gen_len", "8",
            "--num_generations", "8", "--batch_size", "4", "--max_steps", "60", "--learning_rate", "5e-3",
            "--beta", "0", "--reward", "none", "--reward_fn", f"{REWARD_FNS}:digit_share", "--save_dir", out,
            "--checkpoint_dir", f"{out}/ckpt", "--metrics_file", f"{out}/metrics.jsonl", "--save_interval", "1000"]
    proc = forked(SCRIPT, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [r["reward"] for r in metrics_of(argv)]
    assert len(rewards) == 60
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 0.3, rewards


@pytest.mark.parametrize("function,count", [("nan_for_some", 2), ("infinite", 1)])
def test_non_finite_rewards_stop_the_run_naming_the_function(tmp_path, monkeypatch, capsys, function, count):
    """A reward function returning NaN (which counted as 0) or an infinity (which made reward_std Infinity): exit 3
    and one line naming the function, the step and the count, before any update."""
    data = demo_slice(tmp_path, "rlaif", 10)
    argv = [*run_flags(tmp_path, "bad", data), "--reward_fn", f"{REWARD_FNS}:{function}"]
    code, err = run_in_process(monkeypatch, capsys, train_grpo, argv)
    assert code == 3, err
    assert err[-1] == (f"error: step 1: reward function {function} returned {count} non-finite values (NaN or "
                       "infinite) of 4: return finite numbers, or None for no reward; no checkpoint saved yet")


def test_a_reward_function_that_raises_is_named_and_the_last_step_saved(tmp_path, monkeypatch, capsys):
    """Raising at step 3: exit 3, one line naming the function, its error and the step; steps 1-2 are kept (step 2's
    checkpoint, as a preempted run saves it), and a resume with a working function goes on from step 2."""
    data = demo_slice(tmp_path, "rlaif", 40)
    flags = [*run_flags(tmp_path, "raises", data, extra=["--num_iterations", "1", "--save_interval", "100",
                                                          "--max_steps", "4"])]
    failing = [a.replace(":distinct_chars", ":fails_at_step_3") for a in flags]
    code, err = run_in_process(monkeypatch, capsys, train_grpo, failing)
    assert code == 3, err
    checkpoint_dir = flags[flags.index("--checkpoint_dir") + 1]
    saved = glob.glob(os.path.join(checkpoint_dir, "*", "step_*"))
    assert [os.path.basename(path) for path in saved] == ["step_2"]
    assert err[-1] == ("error: step 3: reward function fails_at_step_3 raised KeyError: 'score_service'; step 2 saved "
                       f"in {os.path.dirname(saved[0])}; continue with --from_resume 1"), err
    code, _ = run_in_process(monkeypatch, capsys, train_grpo, [*flags, "--from_resume", "1"])
    assert code in (0, None)
    assert [r["step"] for r in metrics_of(flags)] == [1, 2, 3, 4]


@pytest.mark.parametrize("flags,message", [
    (["--num_generations", "1"], "--num_generations must be at least 2 (got 1; the advantages compare"),
    (["--reward_fn", "missing.py:f"], "--reward_fn missing.py:f: missing.py does not exist"),
    (["--reward_weights", "1,2"], "--reward_weights has 2 values for 1 reward functions"),
    (["--rollout_engine", "vllm"], "--rollout_engine vllm needs --rollout_url"),
    (["--top_p", "0"], "--top_p must lie in (0, 1] (got 0.0)"),
    (["--packing", "1"], "--packing 1: GRPO trains each completion in its own row"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, flags, message):
    data = demo_slice(tmp_path, "rlaif", 10)
    code, err = run_in_process(monkeypatch, capsys, train_grpo, [*run_flags(tmp_path, "bad", data), *flags])
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err


def test_resolve_refuses_split_layouts_without_a_server_and_rewards_that_do_not_add_up(tmp_path, monkeypatch):
    """--tp/--pp with the in-process engine (two processes' layout), reward flags that do not add up: refused in
    resolve, before any process group."""
    data = demo_slice(tmp_path, "rlaif", 10)
    cases = ((["--tp", "2"], "--rollout_engine torch generates with the whole model on each rank, which --tp/--pp"),
             (["--reward", "rule", "--reward_fn", f"{REWARD_FNS}:constant", "--reward_weights", "1,1"],
              "--reward_weights has 2 values for 4 reward functions (the rule terms count 3"),
             (["--reward_model", str(tmp_path / "nothing")], "is not a folder"),
             ([], "no reward: keep --reward rule, or pass --reward_model PATH or --reward_fn FILE.py:NAME"))
    for flags, message in cases:
        argv = [a for a in run_flags(tmp_path, "bad", data) if not a.endswith(":distinct_chars")]
        argv = [a for i, a in enumerate(argv) if not (a == "--reward_fn" and i + 1 < len(argv) and
                                                      argv[i + 1].startswith("--"))]
        monkeypatch.setattr(sys, "argv", ["train_grpo.py", *argv, *flags])
        with pytest.raises(ConfigError) as error:
            resolve(train_grpo.grpo_args(), 2, 0, GRPOPlan)
        assert message in str(error.value), str(error.value)


def test_shared_prompt_rows_give_the_per_completion_loss_and_gradient(monkeypatch, tmp_path):
    """Each prompt's completions in one row, the prompt run once (trainer/core/shared_prefix.py): the step's loss, its
    gradient and its stats equal those of a row per completion within fp32 rounding, on fewer positions."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--loss_type", "grpo", "--beta", "0.1")
    objective = trainer.objective
    assert objective.shared_prompt  # one process: no pipeline
    prepared = objective.prepare(trainer, micro_batches)
    loss, grads, stats = objective_loss(trainer, prepared)
    shared_positions = sum(objective.unpack(batch)[0].numel() for batch in prepared)
    objective.shared_prompt = False
    loss2, grads2, stats2 = objective_loss(trainer, prepared)
    assert shared_positions < sum(ids.numel() for ids, _, _ in prepared)
    assert loss.item() == pytest.approx(loss2.item(), abs=1e-6)  # advantages ~1 times ratios of 1: fp32 rounding
    for g, g2 in zip(grads, grads2):
        assert (g - g2).abs().max().item() <= 1e-5 * g2.abs().max().item() + 1e-8
    for a, b in zip(stats, stats2):
        assert a.keys() == b.keys() and all(a[k].item() == pytest.approx(b[k].item(), rel=1e-5) for k in a)
