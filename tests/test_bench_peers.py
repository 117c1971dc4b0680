"""scripts/benchmarks/peers.py: TRL's side of the peer benchmark trains on the trainer's own tokens in the trainer's
data order (DPO's pairs and SFT's packed rows as the trainer's datasets read them). TRL itself is a benchmark
requirement (requirements-bench.txt), not installed for the tests: its side is run by scripts/bench_peers.py."""
import torch
from torch.utils.data import DistributedSampler

from dataset.chat import SFTDataset
from dataset.preference_data import DPODataset
from scripts.benchmarks.peers import dpo_rows, sft_rows, step_figures


def trainer_order(ds):
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=True)
    sampler.set_epoch(0)
    return list(sampler)


def test_dpo_rows_are_the_trainers_pairs_in_its_order(tmp_path, tokenizer):
    path, rows = dpo_rows(str(tmp_path), tokenizer, 6, 128)
    ds = DPODataset(path, tokenizer, max_length=128, cache_dir=tmp_path / "c")
    assert len(ds) == len(rows) == 6
    for row, index in zip(rows, trainer_order(ds)):
        ids, labels = ds[index][:2]
        for side, k in (("chosen_ids", 0), ("rejected_ids", 1)):
            sequence = torch.tensor(row["prompt_ids"] + row[side])
            targets = labels[k] != -100
            assert torch.equal(ids[k, :len(sequence)], sequence)  # the trainer's tokens up to the last target
            assert targets[len(row["prompt_ids"]):len(sequence)].all() and targets.sum() == len(row[side])


def test_sft_rows_are_the_trainers_packed_rows_without_their_padding(tmp_path, tokenizer):
    path, rows = sft_rows(str(tmp_path), tokenizer, 40, 128)
    ds = SFTDataset(path, tokenizer, max_length=128, cache_dir=tmp_path / "c", packing=True, doc_mask=True)
    assert len(rows) == len(ds)
    for row, index in zip(rows, trainer_order(ds)):
        ids, labels, positions = ds[index]
        n = len(row["input_ids"])
        assert torch.equal(ids[:n], torch.tensor(row["input_ids"])) and torch.equal(labels[:n],
                                                                                   torch.tensor(row["labels"]))
        assert (ids[n:] == tokenizer.pad_token_id).all() and (labels[n:] == -100).all()
        starts = [0] + [sum(row["seq_lengths"][:k]) for k in range(1, len(row["seq_lengths"]))]
        assert sum(row["seq_lengths"]) == n and all(positions[s] == 0 for s in starts)  # one document each


def test_step_figures_by_hand():
    """Steps 3-5 measured after 2 warm-up steps: wall 1, 2, 4 s, CPU 0.5, 1, 1 s, tokens 10, 30, 20."""
    ends = [(0.0, 0.0, 5), (9.0, 9.0, 10), (10.0, 9.5, 20), (12.0, 10.5, 50), (16.0, 11.5, 70)]
    figures = step_figures(ends, warmup=2)
    assert figures["steps"] == 3 and figures["step_time_median"] == 2.0 and figures["steps_per_sec"] == 0.5
    assert figures["tokens_per_sec"] == 20 / 2.0 and figures["tokens_per_cpu_sec"] == 20 / 1.0
