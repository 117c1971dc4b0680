"""scripts/bench.py: step statistics and plan formulas against hand-computed values, plus one tiny real run."""
import json
import os
import subprocess
import sys

import pytest
import torch.nn as nn

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from scripts.bench import parse_args, plan_layout, print_plan, step_stats, trainer_command
from trainer.metrics import step_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def tiny_config():
    # h=8, 2 layers, 2 heads of 4, 1 kv head (kv_dim 4), I=16, V=10
    return MiniMindConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=16, vocab_size=10)


def test_plan_memory_by_hand():
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 + mlp 3*8*16 + 2 norms of 8 + q/k norms of 4 = 64+64+64+384+16+8 = 600
    plan = plan_layout(tiny_config(), seq_len=4, micro_batch=2, num_microbatches=1)
    assert plan["total_params"] == 2 * 600 + 80 + 8
    gib = 2 ** 30
    params = 2 * 600 + 80  # one vocab matrix on the (only) stage; the final norm is left out per stage
    assert plan["memory_gb"]["weights"] * gib == 4 * params
    assert plan["memory_gb"]["grads"] * gib == 4 * params
    assert plan["memory_gb"]["optimizer"] * gib == 8 * params
    # activations: 8 tokens x 2 layers x (12h + 2kv + 4I = 96 + 8 + 64 = 168) x 4 bytes; logits 2 x 4 x 8 x 10
    assert plan["memory_gb"]["activations_per_microbatch"] * gib == 8 * 2 * 168 * 4
    assert plan["memory_gb"]["logits"] * gib == 2 * 4 * 8 * 10
    assert plan["comm_gb_per_step"] == {} and plan["bubble_fraction"] == 0.0


def test_plan_parallel_by_hand():
    gib = 2 ** 30
    cfg = tiny_config()
    plan = plan_layout(cfg, seq_len=4, micro_batch=2, num_microbatches=4, dp=4, tp=2, pp=2, cp=1, zero_stage=0)
    params_rank = (600 + 80) / 2  # 1 layer + vocab matrix per stage, halved by tp
    assert plan["params_per_rank"] == params_rank
    assert plan["comm_gb_per_step"]["dp_allreduce"] * gib == pytest.approx(2 * 3 / 4 * 4 * params_rank)
    # tp: 4 all-reduces x 1 layer x 4 micro-batches x 2(t-1)/t x (8 tokens x h 8 x 4 bytes)
    assert plan["comm_gb_per_step"]["tp_allreduce"] * gib == pytest.approx(4 * 4 * 1 * 256)
    assert plan["comm_gb_per_step"]["pp_p2p"] * gib == pytest.approx(2 * 4 * 256)
    assert plan["bubble_fraction"] == pytest.approx(1 / 5)
    assert plan["memory_gb"]["microbatches_in_flight"] == 2  # 1F1B: pp micro-batches
    gpipe = plan_layout(cfg, 4, 2, 4, pp=2, pp_schedule="gpipe")
    assert gpipe["memory_gb"]["microbatches_in_flight"] == 4
    interleaved = plan_layout(cfg, 4, 2, 4, pp=2, pp_schedule="interleaved1f1b")
    assert interleaved["bubble_fraction"] == pytest.approx(1 / 9)
    zero3 = plan_layout(cfg, 4, 2, 1, dp=4, zero_stage=3)
    assert zero3["memory_gb"]["optimizer"] * gib == pytest.approx(8 * 1280 / 4)
    assert zero3["comm_gb_per_step"]["dp_allgather"] == pytest.approx(2 * zero3["comm_gb_per_step"]["dp_reduce_scatter"])
    cp = plan_layout(cfg, 4, 2, 1, cp=2)  # 4 tokens per rank; K and V blocks of 4 x kv_dim 4 x 4 bytes
    assert cp["comm_gb_per_step"]["cp_kv_ring"] * gib == pytest.approx(3 * 1 * (2 * 4 * 4 * 4) * 2)
    ckpt = plan_layout(cfg, 4, 2, 1, grad_checkpointing=True)
    assert ckpt["memory_gb"]["activations_per_microbatch"] * gib == 8 * (2 * 8 * 4 + 168 * 4)


def test_parse_args_passes_trainer_flags_and_defaults():
    args, flags = parse_args(["--steps", "4", "--packing", "1", "--tp", "2", "--grad_checkpointing", "1"])
    assert args.steps == 4
    assert flags["packing"] == 1 and flags["tp"] == 2 and flags["hidden_size"] == 512 and flags["grad_checkpointing"] == 1
    assert "learning_rate" not in flags  # only given flags and the bench defaults reach the trainer
    with pytest.raises(SystemExit):
        parse_args(["--no_such_flag", "1"])
    argv = trainer_command(dict(flags, loss_chunk_size=0), nproc=2)
    assert "--nproc_per_node=2" in argv and "--packing" in argv


def test_tiny_real_bench_run(tmp_path):
    """One tiny run through the real trainer (< 60 s): a results line with the figures."""
    results = tmp_path / "bench.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--steps", "2", "--warmup", "1",
                    "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2",
                    "--num_key_value_heads", "1", "--max_seq_len", "32", "--batch_size", "2", "--packing", "1",
                    "--results", str(results)], check=True, capture_output=True, text=True, timeout=300)
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


def test_quality_script_same_batches_same_quality(tmp_path):
    """scripts/quality.py end to end (tiny model, 4 steps): the chunked loss on the baseline's batches
    gives the baseline's training loss and held-out loss."""
    results = str(tmp_path / "q.jsonl")
    proc = subprocess.run([sys.executable, "scripts/quality.py", "--steps", "4", "--runs", "baseline,fast-same",
                           "--results", results, "--hidden_size", "64", "--num_hidden_layers", "2",
                           "--num_attention_heads", "4", "--num_key_value_heads", "2", "--max_seq_len", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
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
