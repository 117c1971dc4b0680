"""trainer/train_loop.py helpers that need no process: the effective log interval and steps per epoch."""
from types import SimpleNamespace

import pytest

from trainer.train_loop import effective_log_interval, steps_per_epoch


@pytest.mark.parametrize("log_interval,steps,expected", [
    (100, 6, 1),  # README's first run: 6 steps an epoch, so every step is logged, not only the last
    (100, 250, 25),  # a tenth of the epoch
    (10, 1000, 10),  # the flag when it is the smaller
    (1, 3, 1),
])
def test_a_record_at_least_every_tenth_of_an_epoch(log_interval, steps, expected):
    assert effective_log_interval(SimpleNamespace(log_interval=log_interval), steps) == expected


def test_steps_per_epoch_drops_the_partial_global_batch():
    assert steps_per_epoch(SimpleNamespace(global_batch=8), list(range(60))) == 7
