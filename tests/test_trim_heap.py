"""trainer/observe/metrics.py trim_heap: the heap's free pages go back to the system once the resident set has grown
by TRIM_GROWTH, and not at every step (each trim's pages fault back in on the next step)."""
import torch

from trainer.observe import metrics

BLOCK = 8192  # floats: 32 KiB tensors, below glibc's mmap threshold, so they live in the heap


def test_trims_once_the_resident_set_grew_and_not_before(monkeypatch):
    calls = []
    real = metrics.LIBC

    class CountedLibc:  # the real malloc_trim, its calls counted
        def malloc_trim(self, pad):
            calls.append(pad)
            return real.malloc_trim(pad)

    monkeypatch.setattr(metrics, "LIBC", CountedLibc())
    monkeypatch.setattr(metrics, "_trim", {"next": 0.0, "level": None})
    metrics.trim_heap("cpu")
    metrics.trim_heap("cpu")
    assert calls == []  # the first call sets the level; nothing grew since
    level = metrics._trim["level"]
    assert abs(level - metrics.resident_bytes()) < 0.05 * level  # the resident set at the first call
    blocks = [torch.ones(BLOCK) for _ in range(int(0.4 * level) // (4 * BLOCK))]
    kept = blocks[::2]  # every other block stays: the freed ones cannot merge into the heap's top and leave by sbrk
    del blocks
    before = metrics.resident_bytes()
    assert before > level * metrics.TRIM_GROWTH  # the freed half is still resident
    metrics.trim_heap("cpu")
    after = metrics.resident_bytes()
    assert calls == [0] and before - after > 0.1 * level  # most of the freed 0.2 x level given back
    metrics._trim["next"] = 0.0  # past the time limit: only the level decides now
    metrics.trim_heap("cpu")
    assert calls == [0] and metrics._trim["level"] >= level  # the run's own memory stays: no trim after each step
    del kept
