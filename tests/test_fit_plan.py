"""scripts/fit_plan.py (`scripts/bench.py --plan --gpu NAME`): its memory against the peak measured here for three
configs (dense, MoE, GRPO), its FLOPs against a hand count, the cheapest change that makes a run fit."""
import json
import os

import pytest

from scripts.fit_plan import estimate, memory_parts, stage_plan
from scripts.gpus import GIB
from tests.launch import forked

SMALL = ["--hidden_size", "256", "--num_hidden_layers", "4", "--accumulation_steps", "1", "--dtype", "float32",
         "--device", "cpu"]
CONFIGS = {  # name: (stage, flags); GRPO's prompts are cut at 32 tokens, so its rows are as long as the plan's
    "dense": ("pretrain", SMALL + ["--batch_size", "8", "--max_seq_len", "256"]),
    "moe": ("pretrain", SMALL + ["--batch_size", "8", "--max_seq_len", "256", "--use_moe", "1"]),
    "grpo": ("grpo", SMALL + ["--max_gen_len", "64", "--num_generations", "4", "--max_seq_len", "32"]),
}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the peak resident set is reset on Linux")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_memory_within_15_percent_of_the_measured_peak(tmp_path, name):
    """The measured peak is the process's peak resident set over what it held once its data were loaded
    (tests/memory_entry.py): the model(s), optimizer, activations, rollouts; the estimate's parts summed."""
    stage, flags = CONFIGS[name]
    out = str(tmp_path / "memory.json")
    proc = forked("tests/memory_entry.py", [*flags, "--from_weight", "none", "--max_steps", "3", "--log_interval", "1",
                                            "--save_dir", str(tmp_path / "out"), "--checkpoint_dir",
                                            str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")],
                  env=dict(MINIMIND_TEST_STAGE=f"train_{stage}", MINIMIND_TEST_MEMORY_OUT=out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out) as f:
        measured = json.load(f)
    grown = measured["peak_bytes"] - measured["baseline_bytes"]
    plan, run = stage_plan(stage, flags, 1)
    parts, _ = memory_parts(plan, plan.model.config, run)
    predicted = sum(parts.values())
    assert grown > 0.25 * GIB  # the training state, not noise, is what is compared
    print(f"{name}: estimate {predicted / GIB:.3f} GiB, measured {grown / GIB:.3f} GiB")
    assert abs(predicted / grown - 1) < 0.15, (name, predicted / GIB, grown / GIB, parts)


TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--max_seq_len", "128", "--batch_size", "4", "--accumulation_steps", "2", "--packing", "1"]


def test_flops_and_epoch_time_by_hand():
    """Per trained token: 6 x (the matmul weights a token passes: q, k, v, o of 64x64, 64x32, 64x32, 64x64 and the
    MLP's 3 x 64x256, two layers, the lm_head 6400x64) + 6 x layers x q width x length (causal attention, forward
    and backward); the epoch: that x the corpus's tokens / (peak x MFU)."""
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256
    hand = 6 * (2 * per_layer + 6400 * 64) + 6 * 2 * 64 * 128
    out = estimate("pretrain", TINY, 1, "H100", mfu=0.25, usd_per_hour=3.0, data_tokens=(10 ** 9, 1000, "given"))
    assert out["train_flops_per_token"] == hand
    hours = hand * 10 ** 9 / (989.4e12 * 0.25) / 3600
    assert out["epoch_hours"] == pytest.approx(hours, rel=1e-12)
    assert out["epoch_usd"] == pytest.approx(3.0 * hours, rel=1e-12)
    assert out["params_active"] == out["params_total"]  # dense


def test_moe_active_parameters_by_hand():
    """MoE (the config's experts and top-k): a token passes the shared parts and top-k of the routed experts."""
    out = estimate("pretrain", TINY + ["--use_moe", "1"])
    plan, _ = stage_plan("pretrain", TINY + ["--use_moe", "1"], 1)
    c = plan.model.config
    routed_per_layer = 3 * 64 * c.moe_intermediate_size * c.num_experts
    skipped = 2 * routed_per_layer * (c.num_experts - c.num_experts_per_tok) / c.num_experts
    assert out["params_total"] - out["params_active"] == pytest.approx(skipped, rel=1e-12)


def test_the_cheapest_change_is_the_first_that_fits():
    """A GRPO run of the 104M model does not fit a 24 GB card at its defaults; the change found fits, and the change
    before it in the order (a micro-batch twice as large) does not."""
    flags = ["--hidden_size", "768", "--num_hidden_layers", "16", "--device", "cpu"]
    out = estimate("grpo", flags, 1, "4090")
    assert not out["fits"]
    fix = out["cheapest_fix"]["flags"].split()
    assert fix[:2] == ["--batch_size", "1"]  # the script's 2 halved
    plan, run = stage_plan("grpo", flags + fix, 1)
    assert sum(memory_parts(plan, plan.model.config, run)[0].values()) <= 24 * GIB
