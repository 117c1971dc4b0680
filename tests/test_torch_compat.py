"""model/torch_compat.py: every private torch API it lists exists in the installed torch, and the fallbacks compute
what torch's private calls do (checked against values written out here)."""
import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.nn.functional as F
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh

from model import torch_compat
from model.torch_compat import (
    CPU_FLASH_OP,
    flatten_optim_state_dict,
    foreach_mul_,
    fused_attention_kernels,
)

ATEN_OPS = (CPU_FLASH_OP, "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward")


def test_every_listed_private_api_exists_in_this_torch():
    """An upgrade that drops one fails here by name, before a fallback silently takes over."""
    missing = [name for name in ATEN_OPS if not hasattr(torch.ops.aten, name)]
    missing += [name for owner, name in ((distributed_c10d, "_set_pg_timeout"), (DeviceMesh, "_flatten"),
                                         (torch, "_foreach_mul_"), (torch.amp.GradScaler, "_found_inf_per_device"),
                                         (dcp_state_dict, "_flatten_optim_state_dict")) if not hasattr(owner, name)]
    missing += [name for name in ("_reorder_linear_weight", "_linear_pointwise")
                if torch.backends.mkldnn.is_available() and not hasattr(torch.ops.mkldnn, name)]
    assert not missing, f"torch {torch.__version__} lacks {missing}: update model/torch_compat.py"
    assert isinstance(torch_compat.cpu_bf16_native(), bool)


def test_foreach_mul_fallback_gives_the_products(monkeypatch):
    tensors = [torch.tensor([1.5, -2.0]), torch.tensor([[3.0], [0.25]])]
    scale = torch.tensor(0.375)  # exact products in fp32
    expected = [torch.tensor([0.5625, -0.75]), torch.tensor([[1.125], [0.09375]])]
    foreach_mul_(tensors, scale)  # torch's own kernel
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    monkeypatch.delattr(torch, "_foreach_mul_")
    tensors = [torch.tensor([1.5, -2.0]), torch.tensor([[3.0], [0.25]])]
    foreach_mul_(tensors, scale)  # the loop
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_flatten_optim_state_dict_is_keyed_per_fqn():
    state = {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    flat = flatten_optim_state_dict(state)
    assert set(flat) == {"state.w.step", "state.w.exp_avg", "param_groups.w.lr"}
    assert flat["param_groups.w.lr"] == 0.1 and torch.equal(flat["state.w.exp_avg"], torch.ones(2))


def test_cpu_flash_block_matches_sdpa():
    """The ring's CPU kernel, forward: torch's SDPA on the same block, and its lse the log-sum-exp written out."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    name, forward, _ = next(fused_attention_kernels(q))
    out, lse = forward(q, k, v, True, 16 ** -0.5)
    scores = (q @ k.transpose(-1, -2)) * 16 ** -0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    assert name == "flash_cpu"
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(lse, scores.logsumexp(-1))
