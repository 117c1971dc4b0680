"""On-policy distillation (trainer/rl/gkd.py, trainer/train_gkd.py): the generalized JSD against a float64 hand
computation, the on-policy rows (the prompt cut at the first answer, the student's completion as targets), one process
against DDP on a served rollout, exact resume after a kill, bad input, and the reverse KL going down on a toy run."""
import dataclasses
import glob
import os
import sys

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, kill_at_step, read_metrics, resume_run
from tests.helpers.models import sft_batch
from tests.helpers.rollout_server import LAYOUT_OPTIMIZER, RolloutServer
from trainer import train_gkd
from trainer.base.launch import main_guard
from trainer.core.batches import step_targets
from trainer.core.loop import epoch_batches
from trainer.rl.gkd import GKDObjective, GKDPlan, on_policy_step

SCRIPT = "trainer/train_gkd.py"
STUDENT = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEACHER = MiniMindConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         use_moe=True, num_experts=2)  # MoE and wider: only the vocabulary is shared
TIMING = ("tokens_per_sec", "mfu", "elapsed_s", "peak_mem_gb", "peak_mem_gb_per_rank", "rollout/tokens_per_sec",
          "rollout/time_share")


def seeded(config, seed):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd")
    paths = dict(student=str(root / "student.pth"), teacher=str(root / "teacher.pth"), data=demo_slice(root, "sft", 64),
                 root=str(root))
    for name, config, seed in (("student", STUDENT, 1), ("teacher", TEACHER, 2)):
        model = seeded(config, seed)
        save_weights_file(model.state_dict(), model.config, paths[name])
    return paths


def jsd_by_hand(student_logits, teacher_logits, beta, temperature):
    """Mean over positions of the generalized JSD, float64, written from the definitions: KL(P || Q) = sum P log(P / Q);
    beta 0 KL(teacher || student), 1 KL(student || teacher), else beta KL(t || m) + (1 - beta) KL(s || m)."""
    s = torch.softmax(student_logits.double() / temperature, -1)
    t = torch.softmax(teacher_logits.double() / temperature, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)
    if beta == 0:
        per_position = kl(t, s)
    elif beta == 1:
        per_position = kl(s, t)
    else:
        m = beta * t + (1 - beta) * s
        per_position = beta * kl(t, m) + (1 - beta) * kl(s, m)
    return per_position.mean(), kl(s, t).mean()


def objective_for(teacher, beta, temperature):
    stage = GKDPlan(beta=beta, lmbda=0.0, temperature=temperature, max_prompt_len=64, max_gen_len=8, top_p=1.0,
                    rollout_engine="torch", rollout_url=None, rollout_timeout=60.0, teacher_path="",
                    teacher_fields={})
    return GKDObjective(stage, None, None, None, None, teacher)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_loss_and_gradient_equal_the_jsd_by_hand(files, beta):
    """The loss, its reverse-KL stat and the gradient against the definitions in float64. A low temperature sharpens
    the untrained models' near-uniform distributions, so forward and reverse KL differ (1.6 vs 2.2) and a swapped
    direction or beta fails."""
    input_ids, labels = sft_batch(files["data"])
    student, teacher = seeded(STUDENT, 1), seeded(TEACHER, 2).eval().requires_grad_(False)
    temperature = 0.1
    objective = objective_for(teacher, beta, temperature)
    num_items = objective.count(labels, ())
    loss, _, stats = objective.loss(student, input_ids, step_targets(labels), None, (), num_items)
    grads = torch.autograd.grad(loss, list(student.parameters()))
    mask = labels[:, 1:] != -100
    logits = student(input_ids).logits[:, :-1][mask]
    with torch.no_grad():
        teacher_logits = teacher(input_ids).logits[:, :-1][mask]
    want, want_reverse = jsd_by_hand(logits, teacher_logits, beta, temperature)
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    assert num_items == int(mask.sum()) and want.item() > 0.1  # the teacher is another model: the divergence is not 0
    # fp32 log-probs are off by a few ulp of their size; a P-weighted sum of such errors is no larger than the largest
    largest = float(torch.log_softmax(logits.detach() / temperature, -1).abs().max())
    bound = 4 * torch.finfo(torch.float32).eps * largest
    assert float(loss.detach()) == pytest.approx(want.item(), abs=bound)
    assert float(stats["reverse_kl_sum"]) / num_items == pytest.approx(want_reverse.item(), abs=bound)
    for (name, _), g, w in zip(student.named_parameters(), grads, want_grads):
        # fp32 sums over the vocabulary and the tokens in another order: a few hundred ulp of the largest element
        assert float((g - w.float()).abs().max()) <= 256 * torch.finfo(torch.float32).eps * float(w.abs().max()), name


def test_the_on_policy_steps_are_a_share_lmbda_drawn_from_seed_and_step():
    draws = [on_policy_step(42, step, 0.3) for step in range(2000)]
    assert abs(sum(draws) / 2000 - 0.3) < 4 * (0.3 * 0.7 / 2000) ** 0.5  # four standard deviations of the share
    assert draws == [on_policy_step(42, step, 0.3) for step in range(2000)]  # a resume draws the same
    assert not any(on_policy_step(42, s, 0.0) for s in range(100)) and all(on_policy_step(42, s, 1.0) for s in
                                                                          range(100))


def run_flags(files, name, extra=(), dp=1):
    out = os.path.join(files["root"], name)
    return [*TINY_MODEL, "--data_path", files["data"], "--from_weight", files["student"], "--teacher_weight",
            files["teacher"], "--max_seq_len", "64", "--max_gen_len", "8", "--batch_size", str(2 // dp),
            "--accumulation_steps", "2", "--max_steps", "6", "--learning_rate", "1e-3", "--log_interval", "1",
            "--lmbda", "0.5", "--save_dir", out, "--checkpoint_dir", os.path.join(out, "ckpt"), "--metrics_file",
            os.path.join(out, "metrics.jsonl"), *extra]


def metrics_of(argv):
    return read_metrics(argv[argv.index("--metrics_file") + 1])


def test_on_policy_rows_are_the_prompt_and_the_students_completion(files, monkeypatch):
    """An on-policy step's rows: each loader row's tokens before its first target, then the completion the student
    sampled (EOS included) as the only targets; an offline step trains on the loader's rows as they are."""
    argv = run_flags(files, "rows", ["--lmbda", "1"])
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    trainer, train_ds, _ = train_gkd.build(train_gkd.gkd_args())
    batches = epoch_batches(trainer, train_ds, 0)
    micro_batches = [next(batches) for _ in range(2)]
    rows = trainer.objective.prepare(trainer, micro_batches)
    checked = 0
    for (ids, labels), (new_ids, new_labels) in zip(micro_batches, rows):
        for i in range(ids.shape[0]):
            if (labels[i] == -100).all():  # its answer was cut off at --max_seq_len
                continue
            checked += 1
            prompt = int((labels[i] != -100).nonzero()[0])
            targets = (new_labels[i] != -100).nonzero().squeeze(1)
            assert new_ids[i, :prompt].tolist() == ids[i, :prompt].tolist() and int(targets[0]) == prompt
            assert targets.tolist() == list(range(prompt, prompt + len(targets))) and 1 <= len(targets) <= 8
            assert new_labels[i, targets].tolist() == new_ids[i, targets].tolist()
    assert checked >= 3
    trainer.objective.stage = dataclasses.replace(trainer.plan.stage, lmbda=0.0)
    assert trainer.objective.prepare(trainer, micro_batches) is micro_batches


def test_ddp_equals_the_single_process_on_served_completions(files):
    """The same completions (a rollout server's, a function of the prompt) and the same on-policy steps under DDP
    (2 processes, half the rows each): the same losses, reverse KL and tokens as one process."""
    server = RolloutServer()
    try:
        served = ["--rollout_engine", "vllm", "--rollout_url", server.url, *LAYOUT_OPTIMIZER]
        single, ddp = run_flags(files, "single", served), run_flags(files, "ddp", served, dp=2)
        assert forked(SCRIPT, single).returncode == 0
        proc = forked(SCRIPT, ddp, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        server.close()
    want, got = metrics_of(single), metrics_of(ddp)
    assert {r["on_policy"] for r in want} == {0.0, 1.0}  # both kinds of step are compared
    assert [r["on_policy"] for r in got] == [r["on_policy"] for r in want]
    for a, b in zip(got, want):  # fp32 in another reduction order; SGD keeps it at rounding size (rollout_server.py)
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "reverse_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])


def test_in_process_rollouts_under_zero3_equal_ddp(files):
    """The in-process engine on FSDP2-sharded weights (gathered for the rollout) samples what DDP's whole model
    samples, with the teacher beside the sharded student: the same completions, so the same tokens and losses."""
    runs = {}
    for name, layout in (("ddp_torch", []), ("zero3_torch", ["--zero_stage", "3"])):
        argv = run_flags(files, name, [*LAYOUT_OPTIMIZER, "--max_steps", "4", *layout], dp=2)
        proc = forked(SCRIPT, argv, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics_of(argv)
    assert 1.0 in {r["on_policy"] for r in runs["ddp_torch"]}
    for a, b in zip(runs["zero3_torch"], runs["ddp_torch"]):
        assert a["tokens"] == b["tokens"] and a["on_policy"] == b["on_policy"]
        for key in ("loss", "reverse_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])


def test_resume_after_a_kill_repeats_the_steps_exactly(files):
    """Killed after step 3 (the checkpoint is step 2's): the resumed run draws the same step kinds and rollouts, so
    every record equals the uninterrupted run's."""
    extra = ["--save_interval", "2"]
    straight = run_flags(files, "straight", extra)
    assert forked(SCRIPT, straight).returncode == 0
    run = run_flags(files, "killed", extra)
    kill_at_step("train_gkd", run, 3)
    assert glob.glob(os.path.join(run[run.index("--checkpoint_dir") + 1], "*", "step_2"))
    resume_run(SCRIPT, run, 2)
    got, want = metrics_of(run), metrics_of(straight)
    assert [r["step"] for r in got] == list(range(1, 7)) and {r["on_policy"] for r in want} == {0.0, 1.0}
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_an_offline_step_is_not_called_a_reused_rollout(files):
    """GKD trains an offline step on the data's answers, never on an earlier rollout: its console line said
    "rollout reused" (read from a zero rollout time share), at step 1 too. With seed 42 and lmbda 0.5, step 1 is
    offline and step 2 on-policy (checked against on_policy_step)."""
    argv = run_flags(files, "console", ["--max_steps", "2"])
    assert [on_policy_step(42, step, 0.5) for step in (0, 1)] == [False, True]
    proc = forked(SCRIPT, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {int(line.split()[1]): line for line in proc.stdout.splitlines() if line.startswith("step ")}
    assert [r["on_policy"] for r in metrics_of(argv)] == [0.0, 1.0]
    assert sorted(lines) == [1, 2] and "reused" not in proc.stdout, proc.stdout
    assert lines[1].endswith("| rollout 0% of the time") and "rollout/reused" not in metrics_of(argv)[0]
    assert metrics_of(argv)[1]["rollout/time_share"] > 0 and lines[2].endswith("of the time"), lines[2]


@pytest.mark.parametrize("flag,value,was", [("--lmbda", "0.9", "0.5"), ("--beta", "1", "0.5")])
def test_a_resume_with_another_lmbda_or_beta_is_one_line(files, monkeypatch, capsys, flag, value, was):
    """A finished run's last checkpoint continued with a flag that shaped its steps changed: one line naming the
    flag and both values, exit 2."""
    argv = run_flags(files, "changed_" + flag.strip("-"), ["--max_steps", "2", "--save_interval", "1"])
    assert forked(SCRIPT, argv).returncode == 0
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv, "--from_resume", "1", "--max_steps", "3", flag, value])
    with pytest.raises(SystemExit) as caught:
        main_guard(train_gkd.main)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert f"was saved with {flag} {was}, this run has {flag} {float(value)}" in err, err


def test_reverse_kl_on_the_students_samples_goes_down(files):
    """All steps on-policy with the reverse KL as the loss (beta 1): over 40 steps the student's KL to the teacher on
    its own samples falls to well under its start (the mean of the last 5 steps below 0.7 x the first 5's)."""
    argv = run_flags(files, "toy", ["--lmbda", "1", "--beta", "1", "--max_steps", "40", "--epochs", "3",
                                    "--learning_rate", "3e-3", "--save_interval", "1000"])
    proc = forked(SCRIPT, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kls = [r["reverse_kl"] for r in metrics_of(argv)]
    assert len(kls) == 40 and all(r["on_policy"] == 1.0 for r in metrics_of(argv))
    assert sum(kls[-5:]) / 5 < 0.7 * sum(kls[:5]) / 5, kls


@pytest.mark.parametrize("flags,message", [
    (["--beta", "1.5"], "--beta must lie in [0, 1] (got 1.5)"),
    (["--lmbda", "-0.1"], "--lmbda must lie in [0, 1] (got -0.1)"),
    (["--temperature", "0"], "--temperature must be a positive number (got 0.0)"),
    (["--packing", "1"], "--packing 1: GKD trains each completion in its own row"),
    (["--teacher_weight", "missing"], "missing.pth does not exist; train the teacher first"),
    (["--max_gen_len", "40000"], "--max_seq_len + --max_gen_len = 40064 exceeds the model's"),
])
def test_bad_input_is_one_line_and_exit_2(files, monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *run_flags(files, "bad", flags)])
    with pytest.raises(SystemExit) as caught:
        main_guard(train_gkd.main)
    err = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and err[-1].startswith("error: ") and message in err[-1], err
