"""scripts/bench_loader.py and the loader it times (trainer/core/loop.py:epoch_loader): the batches are the
sampler's rows of the real datasets, the counts are the batches' shapes, the order does not depend on
num_workers, the step estimate is 6N + attention of the real default model, bad input is one line."""
import argparse
import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from dataset.chat import SFTDataset
from dataset.demo_data import ensure_demo_data
from dataset.lm_dataset import PretrainDataset
from model.model_minimind import MiniMindForCausalLM
from scripts.bench_loader import main, step_tokens_per_s, time_loader
from tests.helpers.launch import forked
from trainer.core.data_loading import epoch_loader
from trainer.plan.flags import add_train_args
from trainer.plan.model_config import build_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 64


@pytest.fixture(scope="module")
def datasets():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    return dict(packed=PretrainDataset(ensure_demo_data("pretrain"), tokenizer, max_length=SEQ, packing=True),
                unpacked=PretrainDataset(ensure_demo_data("pretrain"), tokenizer, max_length=SEQ),
                sft=SFTDataset(ensure_demo_data("sft"), tokenizer, max_length=SEQ))


def sampler_order(length, seed, epoch, dp=1, dp_rank=0):
    """DistributedSampler's documented order by hand: randperm seeded seed + epoch, cut to a multiple of dp, strided."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(length, generator=generator).tolist()
    return order[:length // dp * dp][dp_rank::dp]


@pytest.mark.parametrize("dp, dp_rank, skip", [(1, 0, 0), (2, 1, 3)])
def test_loader_yields_the_sampler_rows(datasets, dp, dp_rank, skip):
    ds, seed, epoch, batch = datasets["packed"], 7, 2, 4
    order = sampler_order(len(ds), seed, epoch, dp, dp_rank)
    loader = epoch_loader(ds, epoch, seed, batch, dp=dp, dp_rank=dp_rank, skip_batches=skip)
    assert len(loader) == len(order) // batch - skip
    for k, (input_ids, labels) in zip(range(5), loader):
        rows = [ds[i] for i in order[(skip + k) * batch:(skip + k + 1) * batch]]
        assert torch.equal(input_ids, torch.stack([x for x, _ in rows]))
        assert torch.equal(labels, torch.stack([y for _, y in rows]))


@pytest.mark.parametrize("name", ["packed", "sft"])
def test_num_workers_keep_the_data_order(datasets, name):
    """Every batch of an epoch is the same with 2 worker processes as in the main process (DataLoader's other path)."""
    main_process = list(epoch_loader(datasets[name], 3, 42, 32, num_workers=0))
    workers = list(epoch_loader(datasets[name], 3, 42, 32, num_workers=2))
    assert len(workers) == len(main_process) == len(datasets[name]) // 32
    for (x0, y0), (x2, y2) in zip(main_process, workers):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


@pytest.mark.parametrize("name", ["packed", "unpacked", "sft"])
def test_time_loader_counts_the_batches(datasets, name):
    figures = time_loader(datasets[name], 4, 0, batches=3, warmup=1)
    assert figures["samples"] == 3 * 4 and figures["tokens"] == 3 * 4 * SEQ
    assert figures["tokens_per_s"] == pytest.approx(figures["tokens"] / figures["seconds"])
    paced = time_loader(datasets[name], 4, 0, batches=3, warmup=1, step_seconds=0.02)
    assert paced["seconds"] >= 3 * 0.02 and 0 < paced["stall_share"] < 1


def test_step_estimate_is_6n_plus_attention_of_the_default_model():
    config = build_config(add_train_args(argparse.ArgumentParser()).parse_args([]))
    with torch.device("meta"):  # shapes only
        model = MiniMindForCausalLM(config)
    # weight matrices a token passes through (a tied lm_head counted as the lm_head; the embedding lookup is free)
    matrices = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
                   if p.dim() == 2 and "embed_tokens" not in n)
    # per layer QK^T and AV: 2 x 2 x q_dim x seq FLOPs forward, halved by the causal mask, x3 with backward
    attention = config.num_hidden_layers * 6 * config.num_attention_heads * config.head_dim * 512
    assert step_tokens_per_s(config, 512, 989e12, 0.5) == pytest.approx(989e12 * 0.5 / (6 * matrices + attention))


def test_main_writes_one_record_per_case_and_worker_count(tmp_path):
    results = tmp_path / "loader.jsonl"
    main(["--cases", "packed512", "sft512", "--workers", "0", "--batches", "2", "--warmup", "1",
          "--repeat_corpus", "1", "--results", str(results), "--step_tokens_per_s", "1000"])
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["case"], r["num_workers"]) for r in records] == [("packed512", 0), ("sft512", 0)]
    for r in records:
        assert r["samples"] == 2 * 32 and r["tokens"] == 2 * 32 * 512
        assert r["loader_over_measured_step"] == pytest.approx(r["tokens_per_s"] / 1000)


@pytest.mark.parametrize("args, needle", [
    (["--batches", "0"], "--batches must be at least 1"),
    (["--workers", "0", "-1"], "--workers must be 0 or more"),
    (["--cases", "packed2048", "--repeat_corpus", "1", "--workers", "0"], "raise --repeat_corpus"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    proc = forked("scripts/bench_loader.py", [*args, "--results", str(tmp_path / "r.jsonl")], timeout=120,
                  cwd=os.getcwd())
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.jsonl").exists()
