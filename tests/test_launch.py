"""trainer/base/launch.py: the backend follows the plan's device; token counts are summed on the CPU."""
import pytest

from tests.launch import spawn
from trainer.base.launch import backend_for, count_sum


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl")])
def test_backend_follows_the_device_not_the_host(device, backend):
    """--device cpu on a GPU host must not put CPU tensors through NCCL (and cuda:N takes NCCL)."""
    assert backend_for(device) == backend


def _count_sum(rank, world_size, out):
    # ranks 0,1 are dp rank 0 (one tp pair: same count 5), ranks 2,3 dp rank 1 (count 7)
    value = 5 if rank < 2 else 7
    assert count_sum(value, replicas=2) == 12
    assert count_sum(rank) == 0 + 1 + 2 + 3
    assert count_sum([value, 1], replicas=2) == [12, 2]  # several counts in one collective (items, tokens)


def test_count_sum_over_data_parallel_on_the_cpu(tmp_path):
    spawn(_count_sum, 4, str(tmp_path), timeout=120, start_method="fork")
