"""End-to-end LoRA (trainer/train_lora.py): base frozen, adapters in MiniMind's and PEFT's formats, under sharding.

One single-process run is the reference. A 4-process composite (dp2 x tp2 on FSDP2 ZeRO-3: the adapters sharded
with their column- and row-wise base layers, FSDP2 over a frozen base) and a killed-and-resumed dp2 ZeRO-1 run (DDP
+ the adapters' sharded optimizer state) cover LoRA's own parts: every run's losses and adapters equal the
reference's. Under pp and cp the adapters are the base model's layers, split and sharded as any layer
(tests/test_layouts.py's pp2xcp2 and the other layouts).
"""
import hashlib
import importlib
import json
import os
import sys

import pytest
import torch
from peft import PeftModel
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DistributedSampler
from transformers import AutoTokenizer, Qwen3ForCausalLM

from dataset.chat import SFTDataset
from model.errors import ConfigError
from model.lora import apply_lora_file
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import read_sidecar, save_weights_file
from scripts.convert_model import main as convert_main
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked, read_metrics
from trainer import train_lora
from trainer.base.launch import main_guard
from trainer.plan.flags import parse_args
from trainer.plan.resolve import resolve
from trainer.stages.lora import LoraPlan

SCRIPT = "trainer/train_lora.py"
STEPS = 4
GLOBAL_BATCH = 4  # samples per micro-batch over all dp ranks; 2 micro-batches per step
TARGETS = "q_proj,v_proj,o_proj,up_proj,down_proj"  # column- and row-wise layers, square and not
SCALE = 2.0  # --lora_alpha 8 / --lora_rank 4
STEM = "lora_identity_64"
# Adapters after STEPS AdamW steps in another layout: gradients differ by reduction-order rounding (~1e-6 relative),
# which moves an update lr * g / (|g| + eps) by ~1e-6 * lr where |g| >> eps; 1e-2 * lr per step leaves room for
# elements with |g| within ~100x of eps, and still fails on any real error (one wrong step moves a weight ~lr).
ADAPTER_ATOL = STEPS * 1e-2 * 1e-3
LOGIT_ATOL = 1e-4  # fp32: our model, transformers' and PEFT's differ only in summation order


def read_sidecar_record(path):
    """The sidecar JSON beside a weights file, as written."""
    with open(path[:-len(".pth")] + ".json") as f:
        return json.load(f)


def tiny_config():
    return MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_slice(tmp_path_factory.mktemp("data"), "sft", 64)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The base weights (MiniMind's full_sft file): a seeded model with non-trivial logits."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config())
    path = str(tmp_path_factory.mktemp("base") / "full_sft_64.pth")
    save_weights_file(model.state_dict(), model.config, path)
    return path


def run_args(workdir, data, base, dp, extra=()):
    return [*TINY_MODEL, "--from_weight", base, "--data_path", data, "--max_seq_len", "64",
            "--batch_size", str(GLOBAL_BATCH // dp), "--accumulation_steps", "2", "--learning_rate", "1e-3",
            "--lora_rank", "4", "--lora_alpha", "8", "--lora_targets", TARGETS, "--log_interval", "1",
            "--max_steps", str(STEPS), "--save_interval", "2", "--save_dir", os.path.join(workdir, "out"),
            "--checkpoint_dir", os.path.join(workdir, "ckpt"), "--metrics_file", os.path.join(workdir, "m.jsonl"),
            *extra]


def adapters(workdir):
    return torch.load(os.path.join(workdir, "out", "lora", f"{STEM}.pth"))


def final_model_state(workdir):
    """The full model of the run's last DCP checkpoint (base and adapters)."""
    path = os.path.join(workdir, "full.pt")
    dcp_to_torch_save(os.path.join(workdir, "ckpt", STEM, f"step_{STEPS}"), path)
    return torch.load(path, weights_only=False)["model"]


@pytest.fixture(scope="module")
def reference(data, base, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ref"))
    proc = forked(SCRIPT, run_args(workdir, data, base, 1), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def first_step_loss(base, data):
    """Independent step 1: the plain base model on the conversations of the first global batch of (seed 42, epoch 0),
    each alone and padded (the run packs them, by default): CE summed over them / their target tokens."""
    model = MiniMindForCausalLM(tiny_config())
    model.load_state_dict(torch.load(base))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    packed = SFTDataset(data, tokenizer, max_length=64, packing=True)
    alone = SFTDataset(data, tokenizer, max_length=64)
    sampler = DistributedSampler(packed, num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=True)
    sampler.set_epoch(0)
    rows = list(sampler)[:2 * GLOBAL_BATCH]
    conversations = [int(c) for r in rows for c in packed.row_docs[packed.row_offsets[r]:packed.row_offsets[r + 1]]]
    assert len(conversations) > len(rows)  # the rows do hold several conversations
    input_ids = torch.stack([alone[i][0] for i in conversations])
    labels = torch.stack([alone[i][1] for i in conversations])
    with torch.no_grad():
        return model(input_ids, labels=labels).loss.item()


def test_step_one_is_the_base_and_only_adapters_change(reference, base, data):
    records = read_metrics(os.path.join(reference, "m.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(first_step_loss(base, data), rel=1e-5)  # B = 0: the base model
    base_sd, final = torch.load(base), final_model_state(reference)
    lora_keys = [k for k in final if ".lora." in k]
    assert len(lora_keys) == 2 * 2 * 5  # A and B, 2 layers, 5 targets
    assert all(torch.equal(final[k], base_sd[k]) for k in base_sd)  # the base, bitwise
    assert all(final[k].abs().max() > 0 for k in lora_keys)  # every adapter trained (B started at zero)
    saved = adapters(reference)  # MiniMind's keys <module>.lora.A/B.weight, B holding the scale
    for key in lora_keys:
        parent, _, short, ab, _ = key.rsplit(".", 4)
        value = saved[f"{parent}.{short}.lora.{ab}.weight"]
        assert torch.equal(value, final[key] * (SCALE if ab == "B" else 1.0)), key
    assert read_sidecar(os.path.join(reference, "out", "lora", f"{STEM}.pth"))["hidden_size"] == 64


def folded_logits(base, saved, input_ids):
    """Logits of an independent plain model with W + B @ A folded in by hand (MiniMind's file: B holds the scale)."""
    state = torch.load(base)
    for key, a in saved.items():
        if key.endswith(".lora.A.weight"):
            module = key.removesuffix(".lora.A.weight")
            state[f"{module}.weight"] = state[f"{module}.weight"] + saved[f"{module}.lora.B.weight"] @ a
    model = MiniMindForCausalLM(tiny_config()).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(input_ids).logits


def test_saved_adapters_load_in_minimind_and_peft_format(reference, base, tmp_path):
    input_ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(5))
    path = os.path.join(reference, "out", "lora", f"{STEM}.pth")
    expected = folded_logits(base, adapters(reference), input_ids)
    model = MiniMindForCausalLM(tiny_config()).eval()
    model.load_state_dict(torch.load(base))
    apply_lora_file(model, path)  # model/lora.py's load_lora, as MiniMind's own loader reads the file
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=LOGIT_ATOL)
    assert convert_main(["--weight", base, "--out_dir", str(tmp_path / "hf")]) == 0
    hf_model = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_model, os.path.join(reference, "out", "lora", f"{STEM}_peft")).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=input_ids).logits, expected, rtol=0, atol=LOGIT_ATOL)


def assert_same_as_reference(workdir, reference):
    records, want = read_metrics(os.path.join(workdir, "m.jsonl")), read_metrics(os.path.join(reference, "m.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, ref in zip(records, want):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (got["step"], got["loss"], ref["loss"])
        assert got["tokens"] == ref["tokens"]
    saved, ref_saved = adapters(workdir), adapters(reference)
    assert saved.keys() == ref_saved.keys()
    for key, value in ref_saved.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=ADAPTER_ATOL, msg=key)


def test_dp2_x_tp2_zero3_matches_single_process(reference, base, data, tmp_path):
    flags = ["--tp", "2", "--zero_stage", "3"]
    proc = forked(SCRIPT, nproc=4, args=run_args(str(tmp_path), data, base, 2, flags), timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert_same_as_reference(str(tmp_path), reference)


def test_zero1_resume_after_a_kill_is_exact(reference, base, data, tmp_path):
    """dp2 ZeRO-1 killed after step 3 (checkpoint at step 2), resumed: step 3 again bitwise, and the whole run
    equals the single process."""
    workdir = str(tmp_path)
    args = run_args(workdir, data, base, 2, ["--zero_stage", "1"])
    env = {"MINIMIND_TEST_STAGE": "train_lora", "MINIMIND_TEST_KILL_AT_STEP": "3", "MINIMIND_TEST_KILL_RANK": "1"}
    killed = forked("tests/helpers/fault_entry.py", nproc=2, args=args, timeout=300, env=env)
    assert killed.returncode != 0 and "SIGKILL rank 1 at step 3" in killed.stdout + killed.stderr
    before = read_metrics(os.path.join(workdir, "m.jsonl"))
    assert [r["step"] for r in before] == [1, 2, 3]
    resumed = forked(SCRIPT, nproc=2, args=[*args, "--from_resume", "1"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    after = read_metrics(os.path.join(workdir, "m.jsonl"))
    assert after[2]["loss"] == before[2]["loss"]  # step 3 from the step-2 checkpoint: bitwise the same
    assert_same_as_reference(workdir, reference)


def test_bad_lora_rank_is_one_error_line_before_training(data, base, monkeypatch, capsys, tmp_path):
    """The script's own entry (main_guard(train_lora.main)), in this process: one `error:` line, exit 2, no step."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, run_args(str(tmp_path), data, base, 1, ["--lora_rank", "0"]))])
    with pytest.raises(SystemExit) as caught:
        main_guard(train_lora.main)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err == "error: --lora_rank must be at least 1 (got 0; MiniMind uses 16)"
    assert not os.path.exists(os.path.join(str(tmp_path), "m.jsonl"))  # no step ran


@pytest.mark.parametrize("flags,needle", [
    (["--lora_targets", "q_proj,qkv"], "--lora_targets 'q_proj,qkv': qkv is not one of q_proj,k_proj"),
    (["--lora_targets", ","], "--lora_targets ',': empty is not one of"),
    (["--lora_alpha", "0"], "--lora_alpha must be positive (got 0.0)"),
    (["--lora_dropout", "1"], "--lora_dropout must be in [0, 1) (got 1.0)"),
    (["--lora_name", "a/b"], "--lora_name must be a plain file name"),
    (["--lora_targets", "gate_proj", "--use_moe", "1", "--num_experts", "2"], None),
])
def test_bad_lora_flags_are_config_errors(flags, needle, base, monkeypatch, tmp_path):
    """resolve_lora's checks in-process (main_guard turns a ConfigError into the one line and exit 2, above)."""
    monkeypatch.setattr(sys, "argv", ["train_lora.py", *TINY_MODEL, "--from_weight", "none", "--save_dir",
                                      str(tmp_path), *flags])
    args = parse_args("MiniMind LoRA", LoraPlan, save_weight="lora_identity")
    if needle is None:  # a layer the model has: no error (MoE experts are targets too)
        assert resolve(args, 1, stage=LoraPlan).stage.targets == ("gate_proj",)
        return
    with pytest.raises(ConfigError) as caught:
        resolve(args, 1, stage=LoraPlan)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_the_sidecars_record_tokenizer_and_step_and_the_peft_folder_carries_the_tokenizer(reference):
    """The adapters' sidecar says which tokenizer and which step; the PEFT folder holds that tokenizer's files."""
    sidecar = read_sidecar_record(os.path.join(reference, "out", "lora", f"{STEM}.pth"))
    with open(os.path.join(ROOT, "model", "tokenizer.json"), "rb") as f:
        expected = hashlib.sha256(f.read()).hexdigest()
    assert sidecar["step"] == STEPS and sidecar["tokenizer"] == {"path": os.path.join(ROOT, "model"),
                                                                 "sha256": expected}
    assert sidecar["lora"]["rank"] == 4 and sidecar["lora"]["alpha"] == 8.0
    with open(os.path.join(reference, "out", "lora", f"{STEM}_peft", "tokenizer.json"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == expected


@pytest.mark.parametrize("flags,line", [
    (["--lora_rank", "8"], "step_4 was saved with --lora_rank 4, this run has --lora_rank 8; pass --lora_rank 4 to "
                           "continue it, or --from_resume 0 to start over"),
    (["--lora_alpha", None], "step_4 was saved with --lora_alpha 8.0, this run has --lora_alpha 4.0; pass "
                             "--lora_alpha 8.0 to continue it, or --from_resume 0 to start over"),
    (["--lora_targets", "q_proj,v_proj"], "step_4 was saved with --lora_targets down_proj,o_proj,q_proj,up_proj,"
                                          "v_proj, this run has --lora_targets q_proj,v_proj;"),
    (["--lora_dropout", "0.1"], "step_4 was saved with --lora_dropout 0.0, this run has --lora_dropout 0.1;"),
])
def test_a_resume_with_other_adapter_flags_is_one_line(reference, data, base, flags, line, monkeypatch, capsys):
    """Against the reference run's last checkpoint: the flag, both values and what to pass; exit 2 before any step
    (--lora_alpha left out takes alpha = rank, 4, not the checkpoint's 8)."""
    args = run_args(reference, data, base, 1, ["--from_resume", "1"])
    name = flags[0]
    args = args[:args.index(name)] + args[args.index(name) + 2:] if flags[1] is None else [*args, *flags]
    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, args)])
    with pytest.raises(SystemExit) as caught:
        main_guard(train_lora.main)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith("error: ") and "\n" not in err and line in err, err
    assert len(read_metrics(os.path.join(reference, "m.jsonl"))) == STEPS  # no step was added


@pytest.mark.parametrize("script", ["train_sft", "train_lora", "train_dpo"])
def test_an_adapter_as_from_weight_names_the_flag_and_the_file(reference, script, monkeypatch, capsys, tmp_path):
    adapter = os.path.join(reference, "out", "lora", f"{STEM}.pth")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *TINY_MODEL, "--from_weight", adapter, "--save_dir",
                                      str(tmp_path)])
    with pytest.raises(SystemExit) as caught:
        main_guard(importlib.import_module(f"trainer.{script}").main)
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --from_weight {adapter}: these are LoRA adapters (MiniMind's <module>.lora.A/B.weight), not a "
        "model's weights; pass the base model here and the adapters to --lora (eval_llm.py, convert_model.py)")


def test_a_full_disk_at_the_adapter_save_is_one_line_and_the_resume_writes_the_final_step(
        reference, data, base, tmp_path, small_disk):  # noqa: F811
    """Adapters saved at step 2 (--save_weights_every 2); the disk of --save_dir fills after step 3, so step 4's save
    fails: one line, exit 3, no temporary file, the step-2 adapters intact. With space freed, --from_resume 1 finds
    --max_steps reached, sees the sidecar's step 2 and writes step 4's adapters (the reference run's) before Done."""
    disk = small_disk(2)
    workdir = str(tmp_path)
    args = [*run_args(workdir, data, base, 1, ["--save_weights_every", "2"]), "--save_dir", disk]
    filler = os.path.join(disk, "filler")
    failed = forked("tests/helpers/fault_entry.py", args, env={"MINIMIND_TEST_STAGE": "train_lora",
                                                       "MINIMIND_TEST_FILL_DISK": f"3:{filler}"}, timeout=300)
    err = failed.stderr.strip().splitlines()
    assert failed.returncode == 3, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert err[-1].startswith(f"error: disk full: {disk}/lora needs ") and \
        err[-1].endswith(f"for {disk}/lora/{STEM}.pth but has 0.0 MiB free; the last complete checkpoint is "
                         f"{workdir}/ckpt/{STEM}/step_4; free space or choose another --save_dir, then resume with "
                         "--from_resume 1"), err[-3:]
    files = sorted(os.path.relpath(os.path.join(root, n), disk) for root, _, names in os.walk(disk) for n in names)
    assert not [f for f in files if ".tmp" in f or ".old" in f], files
    assert read_sidecar_record(os.path.join(disk, "lora", f"{STEM}.pth"))["step"] == 2
    os.remove(filler)
    resumed = forked(SCRIPT, [*args, "--from_resume", "1"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{disk}/lora/{STEM}.pth holds step 2, not the final step 4: writing them" in resumed.stdout
    assert f"Done: {STEPS} steps" in resumed.stdout
    assert read_sidecar_record(os.path.join(disk, "lora", f"{STEM}.pth"))["step"] == STEPS
    saved, want = torch.load(os.path.join(disk, "lora", f"{STEM}.pth")), adapters(reference)
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)  # the same run's step 4
