"""scripts/bench.py, the layout model (scripts/planner/cost.py), quality.py: statistics by hand, the layout model
against the real model and a measured run, tiny real bench and quality runs."""
import json

import pytest
import torch.nn as nn

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts import bench, quality
from scripts.bench import parse_args, plan_for, print_plan
from scripts.benchmarks import run as run_helper
from scripts.benchmarks.run import run_trainer, step_stats, trainer_command
from scripts.planner.cost import plan_layout
from tests.helpers.launch import forked_argv
from trainer.observe.metrics import step_flops


def test_step_stats_by_hand():
    records = [dict(step=1, tokens=100, tokens_per_sec=10.0, mfu=0.1, peak_mem_gb=1.0, loss=5.0),
               dict(step=2, tokens=300, tokens_per_sec=100.0, mfu=0.2, peak_mem_gb=1.5, loss=4.0),  # 200 tok, 2 s
               dict(step=3, tokens=400, tokens_per_sec=25.0, mfu=0.4, peak_mem_gb=1.2, loss=3.0),  # 100 tok, 4 s
               dict(step=3, eval_loss=3.5, eval_ppl=33.0)]  # eval records are ignored
    stats = step_stats(records, warmup=1)
    assert stats["steps"] == 2
    assert stats["tokens_per_sec"] == pytest.approx(300 / 6)
    assert stats["step_time_median"] == pytest.approx(3.0)
    assert (stats["step_time_min"], stats["step_time_max"]) == pytest.approx((2.0, 4.0))
    assert stats["mfu"] == pytest.approx((0.2 * 2 + 0.4 * 4) / 6)
    assert stats["peak_mem_gb"] == 1.5 and stats["final_loss"] == 3.0 and stats["final_step"] == 3
    with pytest.raises(ValueError):
        step_stats(records, warmup=3)


def test_layout_model_counts_the_real_models_parameters():
    """plan_layout's parameter count against the real model's (dense and MoE; the lm_head is tied)."""
    for config in (MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                   MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                                  n_shared_experts=1)):
        real = sum(p.numel() for p in MiniMindForCausalLM(config).parameters())  # tied weights counted once
        assert plan_layout(config, seq_len=32, micro_batch=2, num_microbatches=1)["total_params"] == real


def test_layout_model_counts_expert_parallel_by_hand():
    """--ep 2 carved out of dp 4: memory holds half the routed experts (counted on the real model), the experts'
    gradients go to their 2 replicas instead of the dp all-reduce, and the all-to-all bytes are a hand count."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                            n_shared_experts=1)
    routed = sum(p.numel() for name, p in MiniMindForCausalLM(config).named_parameters() if ".experts." in name)
    shape = dict(seq_len=32, micro_batch=2, num_microbatches=3, act_bytes=2)
    whole = plan_layout(config, **shape, layout=dict(dp=4))
    split = plan_layout(config, **shape, layout=dict(dp=4, ep=2))
    assert split["params_per_rank"] == whole["params_per_rank"] - routed / 2
    gb = 2 ** 30
    comm = {k: v * gb for k, v in split["comm_gb_per_step"].items()}
    # 2 layers x 3 micro-batches x (forward + backward) x (out + back) x 64 tokens x 2 slots x h 64 x 2 bytes x 1/2
    assert comm["ep_alltoall"] == pytest.approx(2 * 3 * 2 * 2 * 64 * 2 * 64 * 2 / 2, rel=1e-12)
    assert comm["ep_replica_allreduce"] == pytest.approx(2 * (1 / 2) * 4 * routed / 2, rel=1e-12)  # fp32, 2 replicas
    dense = whole["params_per_rank"] - routed
    assert comm["dp_allreduce"] == pytest.approx(2 * (3 / 4) * 4 * dense, rel=1e-12)
    assert "ep_alltoall" not in whole["comm_gb_per_step"]
    # FSDP2 shards the dense part only
    zero3 = plan_layout(config, **shape, layout=dict(dp=4, ep=2), zero_stage=3)["memory_gb"]
    assert zero3["weights"] * gb == pytest.approx(4 * (dense / 4 + routed / 2), rel=1e-12)


def test_layout_model_counts_expert_parallel_with_tensor_parallel_by_hand():
    """--ep 2 --tp 2 on 4 ranks (ETP=1): each rank holds half the routed experts whole and half of the rest (counted
    on the real model), sends its tp group's full token rows by all-to-all, and tp all-reduces attention only (no
    shared expert; the routed experts' outputs are whole on every tp rank): hand counts."""
    h, inter, layers = 64, 96, 2
    config = MiniMindConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=inter)
    params = dict(MiniMindForCausalLM(config).named_parameters())
    routed = sum(p.numel() for name, p in params.items() if ".experts." in name)
    rest = sum(p.numel() for name, p in params.items() if ".experts." not in name) - h  # the final norm: not per rank
    plan = plan_layout(config, seq_len=32, micro_batch=2, num_microbatches=3, layout=dict(dp=2, tp=2, ep=2),
                       act_bytes=2)
    assert plan["params_per_rank"] == rest / 2 + routed / 2
    assert plan["memory_gb"]["weights"] * 2 ** 30 == pytest.approx(4 * (rest / 2 + routed / 2), rel=1e-12)
    comm = {k: v * 2 ** 30 for k, v in plan["comm_gb_per_step"].items()}
    # 2 layers x 3 micro-batches x (forward + backward) x (out + back) x 64 tokens x 2 slots x h 64 x 2 bytes x 1/2
    assert comm["ep_alltoall"] == pytest.approx(2 * 3 * 2 * 2 * 64 * 2 * 64 * 2 / 2, rel=1e-12)
    assert "ep_replica_allreduce" not in comm  # dp = ep: every expert on one rank per tp rank
    assert comm["dp_allreduce"] == pytest.approx(2 * (1 / 2) * 4 * rest / 2, rel=1e-12)  # the dense half, fp32
    assert plan["comm_gb_per_step"]["tp_allreduces_per_layer"] == 2  # o_proj forward, the q/k/v input backward
    # 2 per layer x 2 layers x 3 micro-batches x ring 2 (1/2) x 64 tokens x h 64 x 2 bytes
    assert comm["tp_allreduce"] == pytest.approx(2 * 2 * 3 * 2 * (1 / 2) * 64 * 64 * 2, rel=1e-12)
    # saved activations per token per layer: 4h norms + (8h + 2 kv 32 x 2) / tp + 4 x 96 x 2 slots whole, bf16; and
    # per layer the grouped GEMMs' stacked gate, up and down weights of this rank's 2 experts: 3 x 2 x 64 x 96, bf16
    per_token = 4 * 64 + (8 * 64 + 2 * 32) / 2 + 4 * 96 * 2
    stacked = 3 * 2 * 64 * 96
    assert plan["memory_gb"]["activations_per_microbatch"] * 2 ** 30 == pytest.approx(
        (64 * 2 * per_token + 2 * stacked) * 2, rel=1e-12)


# the measured model: big enough that activations dominate the batch-size delta, small enough for 2 cores
MEASURED = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_seq_len=256, dtype="float32", device="cpu", packing=1, accumulation_steps=1, max_steps=2,
                log_interval=1, save_interval=10 ** 9)


def test_layout_model_memory_against_a_measured_run(tmp_path):
    """The layout model's memory growth from micro-batch 2 to 16 against the trainer's measured peak RSS growth.

    peak_mem_gb on CPU is the process's ru_maxrss (KiB precision); the difference of two runs cancels the
    interpreter, torch and tokenizer (~0.4 GiB) and leaves the batch-dependent part: saved activations and
    logits, which the model counts, plus autograd's backward temporaries and allocator slack, which it does
    not. Measured here: 1.44x the model's estimate (0.55 GiB vs 0.38 GiB); the model must be within 2x.
    """
    measured, predicted = {}, {}
    for batch in (2, 16):
        flags = dict(MEASURED, batch_size=batch)
        records = run_trainer(flags, str(tmp_path / f"b{batch}.log"))
        measured[batch] = max(r["peak_mem_gb"] for r in records if "peak_mem_gb" in r)
        predicted[batch] = plan_for(flags, 1)[1]["memory_gb"]["total"]
    growth, estimate = measured[16] - measured[2], predicted[16] - predicted[2]
    assert estimate > 0.3  # activations, not noise, are what is compared
    assert 0.5 < growth / estimate < 2.0, (growth, estimate)


def test_parse_args_passes_trainer_flags_and_defaults():
    args, flags = parse_args(["--steps", "4", "--packing", "1", "--tp", "2", "--grad_checkpointing", "1"])
    assert args.steps == 4
    assert flags["packing"] == 1 and flags["tp"] == 2 and flags["grad_checkpointing"] == "1"  # 0/1 or a mode
    assert flags["hidden_size"] == 512
    assert "learning_rate" not in flags  # only given flags and the bench defaults reach the trainer
    with pytest.raises(SystemExit):
        parse_args(["--no_such_flag", "1"])
    argv = trainer_command(dict(flags, loss_chunk_size=0), nproc=2)
    assert "--nproc_per_node=2" in argv and "--packing" in argv


@pytest.fixture
def forked_trainer_runs(monkeypatch):
    """bench.py's and quality.py's trainer runs forked from this process (tests/helpers/launch.py forked): the same
    runs,
    without ~8 s of imports each."""
    monkeypatch.setattr(run_helper, "run_argv", forked_argv)


def test_tiny_real_bench_run(tmp_path, forked_trainer_runs):
    """One tiny run through the real trainer (< 60 s): a results line with the figures."""
    results = tmp_path / "bench.jsonl"
    bench.main(["--steps", "2", "--warmup", "1", "--hidden_size", "32", "--num_hidden_layers", "1",
                "--num_attention_heads", "2", "--num_key_value_heads", "1", "--max_seq_len", "32", "--batch_size", "2",
                "--packing", "1", "--results", str(results)])
    line = json.loads(results.read_text().splitlines()[-1])
    assert line["steps"] == 2 and line["tokens_per_sec"] > 0 and line["peak_mem_gb"] > 0
    assert line["config"]["packing"] == 1 and line["torch"] and line["machine"]


def test_step_flops_counts_the_model_matmuls():
    """MFU's FLOPs: 6 x every Linear weight of the real model (lm_head included) + causal attention,
    with the lm_head counted on target tokens only when the chunked loss skips the rest."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(config)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    seq = 32
    attention = 2 * 6 * 64 * seq  # layers x (QK^T + AV: 4*q_dim*seq/2 causal, x3 fwd+bwd)
    per_token = 6 * matmul_weights + attention
    head = 6 * config.vocab_size * 64
    assert step_flops(config, seq, 100, 40, False) == 100 * per_token
    assert step_flops(config, seq, 100, 40, True) == 100 * (per_token - head) + 40 * head


def test_quality_script_same_batches_same_quality(tmp_path, forked_trainer_runs):
    """scripts/quality.py end to end (tiny model, 4 steps): the chunked loss on the baseline's batches
    gives the baseline's training loss and held-out loss."""
    results = str(tmp_path / "q.jsonl")
    quality.main(["--steps", "4", "--runs", "baseline,fast-same", "--results", results, "--hidden_size", "64",
                  "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
                  "--max_seq_len", "64"])
    with open(results) as f:
        base, fast = [json.loads(line) for line in f]
    assert base["target_tokens"] == fast["target_tokens"] > 0
    assert fast["train_loss"] == pytest.approx(base["train_loss"], rel=1e-5)
    assert fast["heldout_loss"] == pytest.approx(base["heldout_loss"], rel=1e-5)
    assert 7.0 < base["heldout_loss"] < 9.5  # near ln(6400) = 8.76 after 4 steps: a real CE, not a placeholder


def test_plan_counts_logits_as_the_trainer_keeps_them(capsys):
    """--plan follows the trainer's loss path: one chunk of logits (default 1024 rows) in one process,
    the whole micro-batch's vocab-sharded logits under tp (the chunked loss is off there)."""
    tokens, vocab = 32 * 64, 6400
    args, flags = parse_args(["--plan", "--max_seq_len", "64", "--batch_size", "32"])
    assert print_plan(args, flags)["memory_gb"]["logits"] * 2**30 == 2 * 4 * 1024 * vocab
    args, flags = parse_args(["--plan", "--nproc", "2", "--tp", "2", "--max_seq_len", "64", "--batch_size", "32"])
    assert print_plan(args, flags)["memory_gb"]["logits"] * 2**30 == 2 * 4 * tokens * vocab / 2
