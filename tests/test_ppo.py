"""PPO (trainer/rl/ppo.py, train_ppo.py): GAE and the value loss against hand-computed values, the first update on a
rollout against a surrogate written out here, what must not count (prompt, padding, after EOS), the early stop, the
layouts against one process on a real local rollout server, exact resume after a kill (actor and value head), bad
input."""
import glob
import os
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model.errors import ConfigError
from model.weights.shapes import VALUE_HEAD
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked
from tests.helpers.rollout_server import RolloutServer, metrics_of, served_run
from trainer import train_ppo
from trainer.core.batches import step_targets
from trainer.core.loop import epoch_batches, train_step
from trainer.plan.resolve import resolve
from trainer.rl.policy_loss import gae, value_loss
from trainer.rl.ppo import PPOPlan

REWARD_FNS = os.path.join(ROOT, "tests", "helpers", "reward_fns.py")
TEMPERATURE = 0.8


def ppo_flags(tmp_path, data, *extra):
    out = str(tmp_path / "out")
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "48", "--max_gen_len", "10",
            "--batch_size", "3", "--accumulation_steps", "2", "--learning_rate", "1e-3", "--reward", "none",
            "--reward_fn", f"{REWARD_FNS}:distinct_chars", "--temperature", str(TEMPERATURE), "--save_dir", out,
            "--checkpoint_dir", os.path.join(out, "ckpt"), "--cache_dir", os.path.join(out, "c"), *extra]


def in_process_trainer(monkeypatch, tmp_path, *extra):
    """A Trainer built as train_ppo.py builds it (one process), and the step's loader micro-batches."""
    os.makedirs(tmp_path, exist_ok=True)
    data = demo_slice(tmp_path, "rlaif", 40)
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", *ppo_flags(tmp_path, data, *extra)])
    trainer, train_ds = train_ppo.build(train_ppo.ppo_args())
    batches = epoch_batches(trainer, train_ds, 0)
    return trainer, [next(batches) for _ in range(trainer.plan.data.num_microbatches)]


def objective_loss(trainer, prepared):
    """The step's loss as train_step forms it (each micro-batch's share, summed), the gradient and the stats."""
    objective, model = trainer.objective, trainer.model_parts[0]
    unpacked = [objective.unpack(batch) for batch in prepared]
    num_items = sum(objective.count(labels, extra) for _, labels, _, extra in unpacked)
    total, stats = 0.0, {}
    for ids, labels, positions, extra in unpacked:
        loss, _, micro_stats = objective.loss(model, ids, step_targets(labels), positions, extra, num_items)
        total = total + loss
        stats = {k: stats.get(k, 0.0) + float(v) for k, v in micro_stats.items()}
    grads = torch.autograd.grad(total, list(model.parameters()))
    return total.detach(), grads, stats


# ----------------------------------------------------------------------------- GAE and the value loss by hand
def test_gae_with_lambda_one_and_zero_values_is_the_reward_to_go():
    """gamma = lambda = 1, V = 0: A_t = sum of the rewards from t to the row's end; R = A; 0 off the completion."""
    rewards = torch.tensor([[9.0, 1.0, -2.0, 0.5, 3.0, 9.0], [9.0, 9.0, 2.0, 2.0, -1.0, 4.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    advantages, returns = gae(rewards, torch.zeros(2, 6), mask, 1.0, 1.0)
    assert advantages.tolist() == [[0.0, 2.5, 1.5, 3.5, 3.0, 0.0], [0.0, 0.0, 7.0, 5.0, 3.0, 4.0]]
    assert torch.equal(returns, advantages)


def test_gae_by_hand_with_a_discount():
    """gamma 0.9, lambda 0.8 on a 3-token completion inside a padded row (values and rewards off the completion are
    ignored): delta_2 = 2 - 3 = -1, delta_1 = -1 + 0.9*3 - 2 = -0.3, delta_0 = 0.5 + 0.9*2 - 1 = 1.3;
    A_2 = -1, A_1 = -0.3 + 0.72*(-1) = -1.02, A_0 = 1.3 + 0.72*(-1.02) = 0.5656; R = A + V."""
    rewards = torch.tensor([[7.0, 0.5, -1.0, 2.0, 5.0, 5.0]])
    values = torch.tensor([[4.0, 1.0, 2.0, 3.0, 6.0, 6.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    assert advantages[0].tolist() == pytest.approx([0.0, 0.5656, -1.02, -1.0, 0.0, 0.0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.0, 1.5656, 0.98, 2.0, 0.0, 0.0], abs=1e-6)


def test_the_value_loss_is_the_clipped_squared_error():
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), written out per token, c = 0.2."""
    values = torch.tensor([1.0, 1.0, 0.5, -0.3, 2.0])
    old = torch.tensor([0.5, 0.9, 1.0, -0.3, 1.0])
    returns = torch.tensor([0.0, 2.0, 1.2, 0.7, 3.0])
    # clipped V: 0.7 (V moved +0.5), 1.0 (+0.1 inside), 0.8 (-0.5), -0.3 (none), 1.2 (+1.0)
    expected = [0.5 * max(1.0 ** 2, 0.7 ** 2), 0.5 * max(1.0 ** 2, 1.0 ** 2), 0.5 * max(0.7 ** 2, 0.4 ** 2),
                0.5 * max(1.0 ** 2, 1.0 ** 2), 0.5 * max(1.0 ** 2, 1.8 ** 2)]
    loss, clipped = value_loss(values, old, returns, 0.2)
    assert loss.tolist() == pytest.approx(expected, abs=1e-6)
    assert clipped.tolist() == [False, False, False, False, True]


# ----------------------------------------------------------------------------- the loss on a real rollout
def surrogate(model, value_head, prepared, vf_coef):
    """At ratio 1 the policy term's gradient is REINFORCE's: d/dtheta of -A log pi at the sampling temperature (float64
    log-softmax here), and the value term 0.5 (V - R)^2 (V equals V_old: the clip does not bind); both summed over
    the step's completion tokens over their number."""
    total, tokens = 0.0, 0
    for ids, labels, (advantages, returns, _, _, _) in prepared:
        logits = model(ids).logits.double()
        values = value_head.take().double()
        targets = step_targets(labels)
        mask = (targets != -100).double()
        log_probs = torch.log_softmax(logits / TEMPERATURE, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0]
        weight = torch.exp(log_probs - log_probs.detach())  # 1, with log pi's gradient
        total = total + ((-advantages * weight + vf_coef * 0.5 * (values - returns) ** 2) * mask).sum()
        tokens += int(mask.sum())
    return total / tokens


def test_the_first_update_on_a_rollout_has_ratio_one(monkeypatch, tmp_path):
    """A fresh rollout: ratio exactly 1, so approx_kl, policy KL and clipfrac are 0, the value clip does not bind, and
    the loss and gradient are the surrogate's; the advantages are whitened over the step's completion tokens."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--vf_coef", "0.5")
    objective = trainer.objective
    prepared = objective.prepare(trainer, micro_batches)
    loss, grads, stats = objective_loss(trainer, prepared)
    for name in ("approxkl_sum", "policykl_sum", "clipfrac_sum", "vclipfrac_sum"):
        assert stats[name] == 0.0, name
    advantages = torch.cat([extra[0][step_targets(labels) != -100] for _, labels, extra in prepared]).double()
    assert advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert advantages.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    model = trainer.model_parts[0]
    expected = surrogate(model, objective.value_head, prepared, 0.5)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    names = [name for name, _ in model.named_parameters()]
    assert any(name.startswith(VALUE_HEAD) for name in names)  # the value head trains with the actor
    for name, g, e in zip(names, grads, expected_grads):  # fp32 against float64 log-softmax of the same fp32 logits
        assert (g - e).abs().max().item() <= 1e-6, (name, (g - e).abs().max().item())


def test_the_kl_penalty_runs_through_gae_into_prepares_advantages(monkeypatch, tmp_path):
    """A reference off the policy (its weights moved by noise) and kl_coef 0.1, gamma 0.9, lambda 0.8: prepare's
    advantages and returns equal a float64 hand computation from the policy's and the reference's log-probs and the
    values: r_t = -kl_coef (log pi_old - log ref) plus the score at the last token, GAE written as a loop here, the
    advantages whitened over the step's completion tokens (population variance + 1e-8)."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path, "--kl_coef", "0.1", "--gamma", "0.9",
                                                "--lam", "0.8")
    objective, model = trainer.objective, trainer.model_parts[0]
    reference = objective.reference[0][0]
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    prepared = objective.prepare(trainer, micro_batches)
    raw, masks = [], []
    for ids, labels, extra in prepared:
        targets = step_targets(labels)
        mask = (targets != -100).double()
        with torch.no_grad():
            logits = model(ids).logits.double() / TEMPERATURE
            values = objective.value_head.take().double() * mask
            ref_logits = reference(ids).logits.double() / TEMPERATURE
        log_probs = torch.log_softmax(logits, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0] * mask
        ref = torch.log_softmax(ref_logits, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0] * mask
        assert ((log_probs - ref).abs() * mask).max() > 0.01  # the reference is off the policy
        advantages = torch.zeros_like(mask)
        for row in range(mask.shape[0]):
            positions = mask[row].nonzero().flatten().tolist()
            running, next_value = 0.0, 0.0
            for t in reversed(positions):
                reward = -0.1 * float(log_probs[row, t] - ref[row, t])
                if t == positions[-1]:
                    reward += float(extra.row_stats[row, 0])  # the score, at the completion's last token
                delta = reward + 0.9 * next_value - float(values[row, t])
                running = delta + 0.9 * 0.8 * running
                advantages[row, t], next_value = running, float(values[row, t])
        raw.append((advantages, values))
        masks.append(mask)
    tokens = torch.cat([m.flatten() for m in masks]) > 0
    flat = torch.cat([a.flatten() for a, _ in raw])[tokens]
    mean, var = flat.mean(), flat.var(unbiased=False)
    for (_, _, extra), (advantages, values), mask in zip(prepared, raw, masks):
        whitened = (advantages - mean) / torch.sqrt(var + 1e-8) * mask
        # fp32 forwards and sums beside float64 ones: errors ~1e-6 of the O(1) values
        assert (extra.advantages.double() - whitened).abs().max().item() <= 2e-5
        assert (extra.returns.double() - (advantages + values) * mask).abs().max().item() <= 2e-5


def test_prompt_padding_and_tokens_after_eos_change_neither_loss_nor_gradient(monkeypatch, tmp_path):
    """Other tokens after each completion's EOS and more padding columns: the same loss and gradient (only
    completion tokens are targets and values; causal attention keeps later positions out of earlier ones)."""
    trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path)
    prepared = trainer.objective.prepare(trainer, micro_batches)
    loss, grads, _ = objective_loss(trainer, prepared)
    generator, changed = torch.Generator().manual_seed(0), []
    for ids, labels, extra in prepared:
        ids, labels = ids.clone(), labels.clone()
        after = torch.ones_like(labels, dtype=torch.bool)
        for row in range(ids.shape[0]):
            after[row, :int((labels[row] != -100).nonzero().max()) + 1] = False
        ids[after] = torch.randint(3, 6400, (int(after.sum()),), generator=generator)
        ids = torch.cat([ids, torch.randint(3, 6400, (ids.shape[0], 5), generator=generator)], 1)
        labels = torch.cat([labels, torch.full((ids.shape[0], 5), -100)], 1)
        extra = tuple(torch.cat([e, torch.full((e.shape[0], 5), 7.0)], 1) for e in extra[:4]) + extra[4:]
        changed.append((ids, labels, extra))
    assert any((ids[:, :-5] != p[0]).any() for (ids, _, _), p in zip(changed, prepared))
    loss2, grads2, _ = objective_loss(trainer, changed)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-7)
    for g, g2 in zip(grads, grads2):  # other matmul shapes only: fp32 sums in another order, a few ulp of the largest
        assert (g - g2).abs().max().item() <= 8 * 2 ** -24 * g.abs().max().item()


def test_a_rollout_is_trained_on_ppo_update_iters_steps_unless_the_policy_drifts(monkeypatch, tmp_path):
    """--ppo_update_iters 3: one rollout serves three steps, the second and third with the ratio moved off 1; an
    --early_stop_kl below the drift rolls out anew at every step (counted in ppo/early_stops)."""
    rollouts = {}
    for name, early_stop in (("keep", "100"), ("stop", "1e-9")):
        trainer, micro_batches = in_process_trainer(monkeypatch, tmp_path / name, "--ppo_update_iters", "3",
                                                    "--early_stop_kl", early_stop, "--learning_rate", "3e-2")
        engine, calls = trainer.objective.engine, []
        real = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
        records = []
        for _ in range(3):
            metrics = train_step(trainer, micro_batches)
            records.append(trainer.objective.record({k: float(v) for k, v in metrics["stats"].items()},
                                                    metrics["num_items"]))
        rollouts[name] = (len(calls) // trainer.plan.data.num_microbatches, records)
    count, records = rollouts["keep"]
    assert count == 1 and records[0]["ppo/policy/approxkl"] == 0.0
    assert records[1]["ppo/policy/approxkl"] > 0 and records[2]["ppo/policy/clipfrac"] > 0
    assert [r["ppo/early_stops"] for r in records] == [0, 0, 0]
    count, records = rollouts["stop"]
    assert count == 3 and [r["ppo/early_stops"] for r in records] == [0, 1, 1]
    assert all(r["ppo/policy/approxkl"] == 0.0 for r in records)  # every step on a fresh rollout


# ----------------------------------------------------------------------------- end to end
SCRIPT = "trainer/train_ppo.py"
TIMING = ("tokens_per_sec", "mfu", "elapsed_s", "peak_mem_gb", "peak_mem_gb_per_rank", "rollout/tokens_per_sec",
          "rollout/time_share")


def run_flags(tmp_path, name, data, dp=1, extra=()):
    """4 prompts per step (2 micro-batches), 3 steps, each rollout trained twice."""
    out = str(tmp_path / name)
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "32", "--max_gen_len", "8",
            "--batch_size", str(2 // dp), "--accumulation_steps", "2", "--max_steps", "3", "--learning_rate", "1e-3",
            "--ppo_update_iters", "2", "--early_stop_kl", "100", "--reward", "none", "--reward_fn",
            f"{REWARD_FNS}:distinct_chars", "--save_dir", out, "--checkpoint_dir", f"{out}/ckpt", "--cache_dir",
            f"{out}/c", "--metrics_file", f"{out}/metrics.jsonl", "--log_interval", "1", *extra]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A local rollout server, the prompts, and the single process's records."""
    server = RolloutServer()
    data, records = served_run(SCRIPT, run_flags, tmp_path_factory.mktemp("ppo_served"), server)
    yield server, data, records
    server.close()


# PPO's own loss under sharding: the value head on the last pipeline stage (pp2); sharded with the root's parameters
# under FSDP2, and the advantages whitened over both dp ranks (zero3). DDP's dp 2: zero3's; the head replicated
# under tp: tests/test_reward.py's tp2 (the same head class); the RL log-probs of vocab-sharded logits with the old
# policy's and the reference's forwards under tp: tests/test_grpo.py's tp2
@pytest.mark.parametrize("layout", ["zero3", "pp2"])
def test_layouts_equal_the_single_process(served, tmp_path, layout):
    """The same served completions trained under two processes: the same losses, value predictions, returns, KL and
    clipping as one process (the old log-probs, values and the reference in the layout)."""
    server, data, records = served
    _, got = served_run(SCRIPT, run_flags, tmp_path, server, data, layout)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1]["ppo/policy/clipfrac"] > 0 and got[1]["ppo/val/clipfrac"] > 0  # the reused rollout's step
    for a, b in zip(got, records):  # fp32 reductions in other orders; the loss sums ~60 terms of size ~1
        for name in ("loss", "ppo/loss/value", "ppo/policy/approxkl", "ppo/policy/clipfrac", "ppo/val/vpred",
                     "ppo/val/clipfrac", "ppo/returns/mean", "ppo/returns/var", "objective/kl", "ppo/mean_scores",
                     "ppo/policy/entropy"):
            assert a[name] == pytest.approx(b[name], abs=2e-6), (a["step"], name, a[name], b[name])


def final_state(argv):
    """Every tensor (model with its value head, optimizer) of the run's last checkpoint."""
    step = sorted(glob.glob(os.path.join(argv[argv.index("--checkpoint_dir") + 1], "*", "step_*")),
                  key=lambda path: int(path.rsplit("_", 1)[1]))[-1]
    path = os.path.join(os.path.dirname(step), "full.pt")
    dcp_to_torch_save(step, path)
    return torch.load(path, weights_only=False)


def test_resume_after_a_kill_repeats_the_rollouts_and_updates_bitwise(tmp_path):
    """Killed after step 3, the first of two steps on a rollout: the resumed run restores that rollout and its update
    count, so every later record and the final actor, value head and optimizer state equal the uninterrupted run's."""
    data = demo_slice(tmp_path, "rlaif", 40)
    extra = ["--max_steps", "6", "--save_interval", "1"]
    straight = run_flags(tmp_path, "straight", data, extra=extra)
    assert forked(SCRIPT, straight).returncode == 0
    run = run_flags(tmp_path, "killed", data, extra=extra)
    killed = forked("tests/helpers/fault_entry.py", args=run, env={"MINIMIND_TEST_STAGE": "train_ppo",
                                                           "MINIMIND_TEST_KILL_AT_STEP": "3"})
    assert killed.returncode != 0 and "SIGKILL rank 0 at step 3" in killed.stdout + killed.stderr
    saved = {os.path.basename(os.path.dirname(path)) for path in
             glob.glob(os.path.join(run[run.index("--checkpoint_dir") + 1], "*", "step_*", "objective_0.pt"))}
    assert saved == {"step_1", "step_3"}  # where the next step trains on the same rollout
    resumed = forked(SCRIPT, [*run, "--from_resume", "1"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from epoch 0, step 3" in resumed.stdout
    got, expected = metrics_of(run), metrics_of(straight)
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(got, expected):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    state, reference = final_state(run), final_state(straight)
    assert any(k.startswith(VALUE_HEAD) for k in state["model"])
    for part in ("model", "optim"):
        for key, value in reference[part].items():
            if torch.is_tensor(value):
                assert torch.equal(state[part][key], value), key


@pytest.mark.parametrize("flags,message", [
    (["--ppo_update_iters", "0"], "--ppo_update_iters must be at least 1 (got 0)"),
    (["--lam", "1.5"], "--lam must lie in [0, 1] (got 1.5)"),
    (["--clip_epsilon", "0"], "--clip_epsilon must be a positive number (got 0.0)"),
    (["--kl_coef", "-1"], "--kl_coef must be a non-negative number (got -1.0)"),
    (["--tp", "2"], "--rollout_engine torch generates with the whole model on each rank, which --tp/--pp split"),
    (["--packing", "1"], "--packing 1: PPO trains each completion in its own row"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, monkeypatch, flags, message):
    """Refused in resolve, before any process group."""
    data = demo_slice(tmp_path, "rlaif", 10)
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", *ppo_flags(tmp_path, data), *flags])
    with pytest.raises(ConfigError) as error:
        resolve(train_ppo.ppo_args(), 2, 0, PPOPlan)
    assert message in str(error.value), str(error.value)
