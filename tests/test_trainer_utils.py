"""trainer/trainer_utils.py: MiniMind's cosine schedule and the resume batch sampler."""
import math

import pytest

from trainer.trainer_utils import SkipBatchSampler, get_lr


def test_get_lr_matches_minimind_cosine():
    lr, total = 1e-3, 100
    assert get_lr(0, total, lr) == pytest.approx(lr * (0.1 + 0.45 * 2))
    assert get_lr(50, total, lr) == pytest.approx(lr * 0.55)
    assert get_lr(100, total, lr) == pytest.approx(lr * 0.1)
    # warm-up: linear to lr, then the cosine over the remaining steps
    assert get_lr(0, total, lr, warmup_steps=10) == pytest.approx(lr * 0.1)
    assert get_lr(9, total, lr, warmup_steps=10) == pytest.approx(lr)
    assert get_lr(55, total, lr, warmup_steps=10) == pytest.approx(lr * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))))


def test_skip_batch_sampler_skips_and_drops_partial():
    sampler = list(range(11))
    assert list(SkipBatchSampler(sampler, 3)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(SkipBatchSampler(sampler, 3, skip_batches=2)) == [[6, 7, 8]]
    assert len(SkipBatchSampler(sampler, 3, skip_batches=2)) == 1
    assert list(SkipBatchSampler(sampler, 3, skip_batches=5)) == []
