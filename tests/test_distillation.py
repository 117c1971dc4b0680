"""Distillation (trainer/stages/distillation.py, trainer/train_distillation.py): the loss against the formula by hand,
the chunked KL against the full logits, layouts against the single process, exact resume after a kill, bad input."""
import argparse
import copy
import json
import os
import re
import shutil
import sys

import pytest
import torch

from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics
from tests.helpers.models import sft_batch
from trainer import train_distillation
from trainer.base.launch import main_guard
from trainer.core.batches import step_targets
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.stages.distillation import DistillationObjective, DistillationPlan

SCRIPT = "trainer/train_distillation.py"
STUDENT = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# larger and MoE: the teacher shares only the vocabulary with the student
TEACHER = MiniMindConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         use_moe=True, num_experts=2)
STEPS = 4


def seeded(config, seed):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The student's starting weights, a teacher, one with another vocabulary, and a small SFT file."""
    root = tmp_path_factory.mktemp("distill")
    paths = dict(student=str(root / "full_sft_64.pth"), teacher=str(root / "teacher.pth"),
                 other_vocab=str(root / "other_vocab.pth"), data=demo_slice(root, "sft", 64))
    other = MiniMindConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=6000)
    for name, config, seed in (("student", STUDENT, 1), ("teacher", TEACHER, 2), ("other_vocab", other, 3)):
        model = seeded(config, seed)
        save_weights_file(model.state_dict(), model.config, paths[name])
    paths["root"] = str(root)
    return paths


def by_hand(student, teacher, input_ids, labels, alpha, temperature):
    """MiniMind's loss from full logits: mean CE and T^2 * mean KL(teacher || student) over the target tokens."""
    logits = student(input_ids).logits[:, :-1].reshape(-1, STUDENT.vocab_size)
    with torch.no_grad():
        teacher_logits = teacher(input_ids).logits[:, :-1].reshape(-1, STUDENT.vocab_size)
    targets = labels[:, 1:].reshape(-1)
    mask = targets != -100
    logits, teacher_logits, targets = logits[mask], teacher_logits[mask], targets[mask]
    log_q = logits - logits.logsumexp(-1, keepdim=True)
    ce = -log_q.gather(1, targets[:, None]).mean()
    log_p = teacher_logits / temperature - (teacher_logits / temperature).logsumexp(-1, keepdim=True)
    log_q_t = logits / temperature - (logits / temperature).logsumexp(-1, keepdim=True)
    kl = (log_p.exp() * (log_p - log_q_t)).sum(-1).mean()
    return alpha * ce + (1 - alpha) * temperature ** 2 * kl, ce, kl


def objective_loss(student, teacher, input_ids, labels, alpha, temperature, chunk_size):
    stage = DistillationPlan(alpha=alpha, temperature=temperature, teacher_path="", teacher_fields={},
                             chunk_size=chunk_size)
    objective = DistillationObjective(teacher, stage)
    num_items = objective.count(labels, ())
    loss, aux, stats = objective.loss(student, input_ids, step_targets(labels), None, (), num_items)
    return loss, objective.record({k: float(v) for k, v in stats.items()}, num_items)


@pytest.mark.parametrize("chunk_size", [0, 7, 1024])  # full logits, many chunks with a ragged last one, one chunk
def test_loss_and_gradient_equal_the_formula_by_hand(files, chunk_size):
    input_ids, labels = sft_batch(files["data"])
    student, teacher = seeded(STUDENT, 1), seeded(TEACHER, 2).eval().requires_grad_(False)
    alpha, temperature = 0.3, 1.7
    want, want_ce, want_kl = by_hand(student, teacher, input_ids, labels, alpha, temperature)
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    got, record = objective_loss(student, teacher, input_ids, labels, alpha, temperature, chunk_size)
    got_grads = torch.autograd.grad(got, list(student.parameters()))
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5)
    assert record["ce"] == pytest.approx(float(want_ce), rel=1e-5)
    assert record["kl"] == pytest.approx(float(want_kl), rel=1e-4)  # a difference of near-equal log-probs
    assert want_kl > 1e-3  # the teacher is another model: the KL term is tested, not zero
    for (name, _), g, w in zip(student.named_parameters(), got_grads, want_grads):
        # fp32 sums over the 6400-way vocabulary and the tokens, in another order: a few hundred ulp of the largest
        assert float((g - w).abs().max()) <= 256 * torch.finfo(torch.float32).eps * float(w.abs().max()), name


def test_mfu_counts_the_teachers_forward():
    """MFU's FLOPs: the student's 6 x its Linear weights + causal attention, plus the teacher's forward: 2 x its
    Linear weights + its forward attention (lm_heads on target tokens only under the chunked KL), by hand."""
    student_config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    fields = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2)
    stage = DistillationPlan(alpha=0.5, temperature=1.0, teacher_path="", teacher_fields=fields, chunk_size=64)
    seq, positions, targets = 32, 100, 40
    weights = [sum(m.weight.numel() for m in MiniMindForCausalLM(c).modules() if isinstance(m, torch.nn.Linear))
               for c in (student_config, stage.teacher_config)]
    heads = [student_config.vocab_size * 64, stage.teacher_config.vocab_size * 96]
    # causal attention per token and layer: QK^T and AV, 2 x 2 x q_dim x seq / 2 forward; x3 with the backward
    attention = [2 * (3 * 2 * 64 * seq), 3 * (2 * 96 * seq)]  # the student trains, the teacher runs forward
    full = (6 * weights[0] + attention[0] + 2 * weights[1] + attention[1]) * positions
    chunked = full - (6 * heads[0] + 2 * heads[1]) * (positions - targets)
    objective = DistillationObjective(None, stage)
    assert objective.flops(student_config, seq, positions, targets, False) == pytest.approx(full, rel=1e-12)
    assert objective.flops(student_config, seq, positions, targets, True) == pytest.approx(chunked, rel=1e-12)


@pytest.mark.parametrize("chunk_size", [0, 16])
def test_teacher_equal_to_student_with_alpha_0_gives_zero(files, chunk_size):
    input_ids, labels = sft_batch(files["data"])
    student = seeded(STUDENT, 1)
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    loss, record = objective_loss(student, teacher, input_ids, labels, 0.0, 1.5, chunk_size)
    grads = torch.autograd.grad(loss, list(student.parameters()))
    assert float(loss) == 0.0 and record["kl"] == 0.0 and record["ce"] > 1.0  # same logits: p log(p / p) = 0
    ce_loss, _ = objective_loss(student, teacher, input_ids, labels, 1.0, 1.5, chunk_size)
    ce_grads = torch.autograd.grad(ce_loss, list(student.parameters()))
    for g, scale in zip(grads, ce_grads):  # q - p is 0; autograd's log_softmax backward forms q * sum(p) - p
        assert float(g.abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(scale.abs().max())


def run_args(files, name, accumulation_steps, extra=()):
    out = os.path.join(files["root"], name)
    return [*TINY_MODEL, "--data_path", files["data"], "--max_seq_len", "64", "--batch_size", "2",
            "--accumulation_steps", str(accumulation_steps), "--learning_rate", "2e-3", "--log_interval", "1",
            "--max_steps", str(STEPS), "--from_weight", files["student"], "--teacher_weight", files["teacher"],
            "--alpha", "0.3", "--temperature", "2", "--loss_chunk_size", "16", "--save_dir", out,
            "--checkpoint_dir", os.path.join(out, "ckpt"), "--metrics_file", os.path.join(out, "metrics.jsonl"),
            *extra]


def metrics(argv):
    return read_metrics(argv[argv.index("--metrics_file") + 1])


@pytest.fixture(scope="module")
def single(files):
    """The single-process run every layout and the resumed run are compared with (global batch 8)."""
    argv = run_args(files, "single", 4)
    proc = forked(SCRIPT, argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "default full_sft" in proc.stdout and "hidden 96, MoE" in proc.stdout
    records = metrics(argv)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # the logged loss is its two logged parts, mixed
        assert r["loss"] == pytest.approx(0.3 * r["ce"] + 0.7 * 4 * r["kl"], rel=1e-6)
    return records


def assert_same_steps(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):  # fp32 in another reduction order, a few optimizer steps on
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "ce", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])


def test_tp2_equals_the_single_process(files, single):
    """tp 2: both models' logits vocab-sharded, the KL between them under loss_parallel. ZeRO-3 (the lm_head freed
    after forward and gathered again for the chunked loss's backward): test_zero3_resume_after_a_kill_is_exact."""
    argv = run_args(files, "layout_tp2", 4, ["--tp", "2", "--loss_chunk_size", "0"])
    proc = forked(SCRIPT, nproc=2, args=argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_steps(metrics(argv), single)


KILL_AT = """import os, signal, sys
sys.path.insert(0, {root!r})
from trainer import train_distillation
from trainer.core import loop as train_loop
from trainer.base.launch import main_guard, rank
real_after_step = train_loop.after_step
def after_step(trainer, *args, **kwargs):
    real_after_step(trainer, *args, **kwargs)
    if trainer.progress.global_step == {step} and rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
train_loop.after_step = after_step
main_guard(train_distillation.main)
"""


def test_zero3_resume_after_a_kill_is_exact(files, single, tmp_path):
    """dp 2 under ZeRO-3 (FSDP2: the lm_head is freed after forward and gathered again for the chunked loss's
    backward): SIGKILL rank 0 after step 3 (the checkpoint is step 2's); the resumed run repeats step 3 exactly and
    every step equals the single process."""
    argv = run_args(files, "killed", 2, ["--save_interval", "2", "--zero_stage", "3"])
    entry = tmp_path / "kill_at_step.py"  # the trainer has no test hooks: the fault is patched in from here
    entry.write_text(KILL_AT.format(root=ROOT, step=3))
    killed = forked(str(entry), nproc=2, args=argv, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]  # rank 0 died of the SIGKILL (forked ranks: its status)
    before = metrics(argv)
    assert [r["step"] for r in before] == [1, 2, 3]
    resumed = forked(SCRIPT, nproc=2, args=argv + ["--from_resume", "1"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from epoch 0, step 2" in resumed.stdout
    got = metrics(argv)
    assert_same_steps(got, single)
    for key in ("loss", "ce", "kl"):  # the same layout and reduction order: step 3 again, bit for bit
        assert got[2][key] == before[2][key], (key, got[2][key], before[2][key])


def test_teacher_with_another_vocabulary_is_one_line_exit_2(files):
    proc = forked(SCRIPT, run_args(files, "bad", 4, ["--teacher_weight", files["other_vocab"]]), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --teacher_weight") and "has vocab_size 6000, the student 6400" in last, last


def resolve_flags(files, flags, world_size=1):
    parser = argparse.ArgumentParser()
    add_train_args(parser, DistillationPlan)
    return resolve(parser.parse_args(run_args(files, "bad", 4, flags)), world_size, stage=DistillationPlan)


@pytest.mark.parametrize("flags,world_size,message", [
    (["--alpha", "1.5"], 1, "--alpha must lie in [0, 1] (got 1.5)"),
    (["--temperature", "0"], 1, "--temperature must be a positive number (got 0.0)"),
    (["--teacher_weight", "missing"], 1, "missing.pth does not exist; train the teacher first"),
    (["--pp", "2"], 2, "--pp > 1 is not supported by distillation"),
])
def test_bad_flags_are_config_errors(files, flags, world_size, message):
    """The checks main_guard turns into one `error:` line and exit 2 (the test above runs that path)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_flags(files, flags, world_size)


def test_teacher_with_another_tokenizer_is_refused(files, tmp_path):
    """An HF-folder teacher brings its tokenizer: the same vocabulary size with two ids swapped is refused."""
    folder = tmp_path / "teacher_hf"
    seeded(STUDENT, 4).save_pretrained(folder)
    with open(os.path.join(ROOT, "model", "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġi"] = vocab["Ġi"], vocab["Ġthe"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(os.path.join(ROOT, "model", "tokenizer_config.json"), folder)
    with pytest.raises(ConfigError, match="its tokenizer .* differs from the student's"):
        resolve_flags(files, ["--teacher_weight", str(folder)])
    shutil.copy(os.path.join(ROOT, "model", "tokenizer.json"), folder)  # the student's own: accepted
    assert resolve_flags(files, ["--teacher_weight", str(folder)]).stage.teacher_fields["hidden_size"] == 64


@pytest.mark.parametrize("flag,value,was", [("--alpha", "0.5", "0.3"), ("--temperature", "1", "2.0"),
                                            ("--teacher_weight", "other", None)])
def test_a_resume_with_another_teacher_alpha_or_temperature_is_one_line(files, single, flag, value, was,
                                                                        monkeypatch, capsys):
    """The single run's last checkpoint (step 4) continued with one of the flags that shaped its state changed: one
    line naming the flag and both values, exit 2, no step."""
    if value == "other":  # the same shapes, other weights: told apart by content
        value = os.path.join(files["root"], "other_teacher.pth")
        save_weights_file(seeded(TEACHER, 5).state_dict(), TEACHER, value)
    argv = run_args(files, "single", 4, ["--from_resume", "1", "--max_steps", str(STEPS + 1), flag, value])
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    with pytest.raises(SystemExit) as caught:
        main_guard(train_distillation.main)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    if was is None:
        assert f"step_4 was saved with --teacher_weight {files['teacher']} (sha256 " in err
        assert f", this run has --teacher_weight {value} (sha256 " in err
        assert err.endswith(f"pass --teacher_weight {files['teacher']} to continue it, or --from_resume 0 to start "
                            "over")
    else:
        assert err.endswith(f"step_4 was saved with {flag} {was}, this run has {flag} {float(value)}; pass {flag} "
                            f"{was} to continue it, or --from_resume 0 to start over"), err
    assert len(metrics(run_args(files, "single", 4))) == STEPS
