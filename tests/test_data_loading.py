"""trainer/core/data_loading.py LongestRows and TrainPlan.row_multiple: each micro-batch of right-padded rows is cut to
its longest row (rounded up to the layout's multiple), and every stage that trains on such rows computes what it
computed on rows padded to --max_seq_len: SFT unpacked, pretraining unpacked, DPO, KTO, the reward model,
distillation."""
from types import SimpleNamespace

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from tests.helpers.launch import TINY_CONFIG, TINY_MODEL, demo_slice, forked, read_metrics, run_in_process
from trainer import train_distillation, train_dpo, train_full_sft, train_kto, train_pretrain, train_reward
from trainer.core.data_loading import LongestRows, longest_row
from trainer.plan.sections import TrainPlan

PAD = 0


def row_multiple(device="cpu", cp=1, tp=1, pp=1, sequence_parallel=False, packing=False, padded_rows=True):
    """TrainPlan.row_multiple of a plan with these fields."""
    return TrainPlan.row_multiple.fget(SimpleNamespace(layout=SimpleNamespace(device=device, cp=cp, tp=tp, pp=pp,
                                                  sequence_parallel=sequence_parallel),
                           data=SimpleNamespace(packing=packing), stage=SimpleNamespace(padded_rows=padded_rows)))


def padded(lengths, width, labelled_from=1):
    """(input_ids, labels) rows of tokens 5.. of the given lengths, then PAD; labels from `labelled_from` on."""
    input_ids = torch.full((len(lengths), width), PAD)
    labels = torch.full((len(lengths), width), -100)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.arange(5, 5 + n)
        labels[i, labelled_from:n] = input_ids[i, labelled_from:n]
    return input_ids, labels


def test_a_batch_is_cut_to_its_longest_row_rounded_up_and_never_past_its_width():
    input_ids, labels = padded([3, 13, 9], 64)
    margins = torch.tensor([0.5])
    ids, lab, rest = LongestRows(PAD, 8).cut([input_ids, labels, margins])
    assert ids.shape == lab.shape == (3, 16) and rest is margins  # 13 -> 16; the other tensors as they came
    assert torch.equal(ids, input_ids[:, :16]) and torch.equal(lab, labels[:, :16])
    assert (input_ids[:, 16:] == PAD).all() and (labels[:, 16:] == -100).all()  # only padding was cut
    assert LongestRows(PAD, 64).cut([input_ids, labels])[0].shape == (3, 64)  # 13 -> 64: the whole width
    assert LongestRows(PAD, 8).cut((*padded([61], 64),))[0].shape == (1, 64)  # 64 is at most the width, a tuple
    pairs = torch.stack([input_ids[:2], input_ids[1:]]), torch.stack([labels[:2], labels[1:]])  # (B, 2, L) pairs
    assert LongestRows(PAD, 8).cut(list(pairs))[0].shape == (2, 2, 16)


def test_a_row_runs_to_its_last_token_or_target():
    """The longest row counts a trailing unlabelled token (the reward model reads the last non-pad one) and a target
    whose token is the padding id (a real token that happens to share it)."""
    input_ids, labels = padded([4, 7], 32, labelled_from=2)
    assert longest_row(input_ids, labels, PAD) == 7
    labels[0, 4:7] = -100  # unlabelled tokens still count
    assert longest_row(input_ids, labels, PAD) == 7
    input_ids[1, 6] = PAD
    labels[1, 6] = -100
    assert longest_row(input_ids, labels, PAD) == 6
    input_ids[0, 20], labels[0, 20] = PAD, PAD  # a target token equal to the padding id
    assert longest_row(input_ids, labels, PAD) == 21
    assert longest_row(torch.full((2, 8), PAD), torch.full((2, 8), -100), PAD) == 1


def test_the_multiple_fits_every_layout_that_splits_a_row():
    assert row_multiple() == 8 and row_multiple("cuda:0") == 64
    assert row_multiple(cp=3) == 24  # each cp rank holds a head and a tail chunk: 2*cp divides the length
    assert row_multiple(tp=2, cp=2, sequence_parallel=True) == 8  # L/cp split again over tp: cp*tp = 4 divides 8
    assert row_multiple(tp=3, cp=2, sequence_parallel=True) == 24
    assert row_multiple(tp=3) == 8  # tp ranks see whole rows without sequence parallel
    assert row_multiple(tp=3, sequence_parallel=True) == 24
    for kept in (dict(pp=2), dict(packing=True), dict(padded_rows=False)):
        assert row_multiple(**kept) is None  # fixed stage shapes, full packed rows, RL's prompts: never cut


# ----------------------------------------------------------------------------- each stage, padded to max vs cut
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny student (the SFT start) and a tiny teacher for distillation, seeded."""
    root = tmp_path_factory.mktemp("cut_weights")
    paths = {}
    for name, seed in (("student", 1), ("teacher", 2)):
        torch.manual_seed(seed)
        model = MiniMindForCausalLM(MiniMindConfig(**TINY_CONFIG))
        paths[name] = str(root / f"{name}.pth")
        save_weights_file(model.state_dict(), model.config, paths[name])
    return paths


STAGES = {  # script, demo corpus, flags of its own
    "sft": (train_full_sft, "sft", lambda w: ["--from_weight", w["student"], "--packing", "0"]),
    "pretraining": (train_pretrain, "pretrain", lambda w: ["--packing", "0"]),
    "dpo": (train_dpo, "dpo", lambda w: ["--from_weight", "none"]),
    "kto": (train_kto, "kto", lambda w: ["--from_weight", "none"]),
    "reward": (train_reward, "dpo", lambda w: ["--from_weight", "none"]),
    "distillation": (train_distillation, "sft", lambda w: ["--from_weight", w["student"], "--packing", "0",
                                                           "--teacher_weight", w["teacher"], "--alpha", "0.3",
                                                           "--temperature", "2"]),
}
STEPS = 2
REAL_CUT = LongestRows.cut
COMPARED = ("loss", "grad_norm", "ce", "kl", "accuracy", "margin")  # and each stage's rewards/*


def stage_run(monkeypatch, capsys, tmp_path, stage, weights, cut):
    """(records, the row widths the loader gave) of a STEPS-step run at --max_seq_len 128; cut=False: LongestRows
    leaves every batch padded to --max_seq_len, as before it existed."""
    script, corpus, flags = STAGES[stage]
    out = tmp_path / ("cut" if cut else "full")
    widths = []

    def recorded_cut(self, batch):
        batch = REAL_CUT(self, batch) if cut else batch
        widths.append(batch[0].shape[-1])
        return batch
    monkeypatch.setattr(LongestRows, "cut", recorded_cut)
    argv = [*TINY_MODEL, "--data_path", demo_slice(tmp_path, corpus, 24), "--max_seq_len", "128", "--batch_size", "2",
            "--accumulation_steps", "2", "--learning_rate", "1e-3", "--log_interval", "1", "--max_steps", str(STEPS),
            "--save_dir", str(out), "--checkpoint_dir", str(out / "ckpt"), "--cache_dir", str(tmp_path / "cache"),
            "--metrics_file", str(out / "metrics.jsonl"), *flags(weights)]
    code, err = run_in_process(monkeypatch, capsys, script, argv)
    assert code == 0, err[-20:]
    return read_metrics(str(out / "metrics.jsonl")), widths


@pytest.mark.parametrize("stage", list(STAGES))
def test_rows_cut_to_the_longest_train_as_rows_padded_to_max_seq_len(monkeypatch, capsys, tmp_path, weights, stage):
    """Step 1 starts from the same weights: its loss, gradient norm and the stage's own values are those of the full
    rows up to fp32 rounding. Cutting only drops positions after every row's last token and target: causal attention
    gives each kept position the same inputs, so what may differ is the order of fp32 sums over a shorter row
    (matmul blocking, the loss's reductions): a few ulps of each sum, 1e-6 relative (values near 0, the rewards at
    step 1, 1e-6 absolute). Step 2 follows one AdamW step from gradients equal to rounding: 1e-5. (Measured here:
    bit-equal mostly, at most 1.5e-6 relative at step 2.)"""
    want, full_widths = stage_run(monkeypatch, capsys, tmp_path, stage, weights, cut=False)
    got, widths = stage_run(monkeypatch, capsys, tmp_path, stage, weights, cut=True)
    assert set(full_widths) == {128} and min(widths) < 128 and all(w % 8 == 0 for w in widths), widths
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert a["tokens"] == b["tokens"]
        keys = [k for k in b if k in COMPARED or k.startswith("rewards/")]
        for key in keys:
            tolerance = 1e-6 if a["step"] == 1 else 1e-5
            assert a[key] == pytest.approx(b[key], rel=tolerance, abs=1e-6), (stage, a["step"], key, a[key], b[key])


def test_cut_rows_under_context_parallel_equal_the_single_process(tmp_path, weights):
    """SFT unpacked on 3 context-parallel ranks: rows cut to multiples of lcm(8, 2*cp) = 24 (each rank a head and a
    tail chunk of 4 positions at least) train as the single process's rows cut to multiples of 8; the ring's other
    reduction order: 1e-5 relative."""
    runs, data = {}, demo_slice(tmp_path, "sft", 24)
    for name, nproc, flags in (("single", 1, []), ("cp3", 3, ["--cp", "3"])):
        out = tmp_path / name
        argv = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "120", "--packing", "0",
                "--batch_size", "2", "--accumulation_steps", "2", "--learning_rate", "1e-3", "--log_interval", "1",
                "--max_steps", str(STEPS), "--from_weight", weights["student"], "--save_dir", str(out),
                "--checkpoint_dir", str(out / "ckpt"), "--cache_dir", str(tmp_path / "cache"),
                "--metrics_file", str(out / "metrics.jsonl"), *flags]
        proc = forked("trainer/train_full_sft.py", argv, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = read_metrics(str(out / "metrics.jsonl"))
    for a, b in zip(runs["cp3"], runs["single"], strict=True):
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])
