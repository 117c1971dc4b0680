"""The process's memory during training (trainer/observe/metrics.py): trim_heap gives the heap's free pages back to the
system once the resident set has grown by TRIM_GROWTH, and not at every step (each trim's pages fault back in on the
next step); start_up_frozen keeps start-up's objects out of the garbage collector's walks while the loop runs."""
import gc
import weakref

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


class Node:
    pass


def test_start_up_objects_leave_the_collectors_walks_while_the_loop_runs():
    before = Node()
    before.me = before  # a cycle made at start-up: alive, and walked by every full collection until frozen
    assert any(o is before for o in gc.get_objects())
    with metrics.start_up_frozen():
        assert gc.get_freeze_count() > 0 and not any(o is before for o in gc.get_objects())
        during = Node()
        during.me = during  # garbage the loop makes is still collected
        gone = weakref.ref(during)
        del during
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0 and any(o is before for o in gc.get_objects())  # back when the loop ends
