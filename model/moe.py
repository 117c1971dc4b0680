"""MiniMind's mixture-of-experts MLP (config.use_moe): top-k routed SwiGLU experts with the sequence-level aux loss,
run as grouped GEMMs or a loop; a MoE model's blocks build it (model/model_minimind.py MiniMindBlock), a dense run never
reads this file.

Imported relatively by model/model_minimind.py, as scripts/convert_model.py ships both files as an export's remote code;
the hooks parallelism sets from outside (`reduce_router_stats`, `seq_len_scale`, `experts_fn`, `expert_compute`) are in
docs/design.md.
"""
import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_op():
    """torch's grouped matmul: F.grouped_mm (torch >= 2.10), torch._grouped_mm (2.8, 2.9), or None. Listed in
    model/torch_compat.py (GROUPED_MM_OPS) but looked up here: this file ships as remote code without it."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_EXPERT_COMPUTE = {}  # (device type, dtype, hidden, intermediate) -> "grouped" | "loop", probed once per process


def expert_compute_for(device, dtype, hidden, intermediate):
    """How the experts run on this device and dtype: "grouped" (one grouped GEMM per projection, split sizes stay on
    the device) where torch has a grouped matmul that runs these shapes forward and backward, else "loop"."""
    key = (torch.device(device).type, dtype, hidden, intermediate)
    if key not in _EXPERT_COMPUTE:
        _EXPERT_COMPUTE[key] = "loop"
        op = grouped_mm_op()
        if op is not None:
            try:  # a tiny probe: the CUDA kernels ask for bf16 and sm80+ on some versions, 16-byte aligned rows
                with torch.inference_mode(False), torch.enable_grad():
                    rows = torch.ones(4, hidden, device=device, dtype=dtype, requires_grad=True)
                    weights = torch.ones(2, intermediate, hidden, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
                    out = op(rows, weights.transpose(1, 2), offs=offs)
                    out.backward(torch.ones_like(out))
                _EXPERT_COMPUTE[key] = "grouped"
            except (RuntimeError, NotImplementedError, TypeError):
                pass
    return _EXPERT_COMPUTE[key]


def in_backward():
    """True while autograd runs a backward (an activation-checkpointed block recomputing its forward)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class MOEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts (+ optional always-on shared experts) with a sequence-level aux loss.

    expert_bias (None unless set, e.g. by aux-loss-free balancing): added to the routing scores for the top-k choice
    only, not to the gate weights (DeepSeek-V3); when set it is saved in the state dict. routed_tokens: tokens each
    expert received in training forwards since the owner last reset it (per-expert load; no host sync)."""

    def __init__(self, config, mlp):
        """mlp: the dense MLP class (model_minimind.FeedForward), called as mlp(config, moe_intermediate_size) for each
        expert; passed in, as this file imports nothing of the model's."""
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([mlp(config, config.moe_intermediate_size) for _ in range(config.num_experts)])
        if config.n_shared_experts > 0:
            self.shared_experts = nn.ModuleList(
                [mlp(config, config.moe_intermediate_size) for _ in range(config.n_shared_experts)])
        self.seq_len_scale = 1  # context parallel sets its group size: local L * scale = full sequence length
        self.expert_compute = None  # "grouped" | "loop"; None: expert_compute_for at the first forward
        self.experts_fn = None  # (rows sorted by expert, counts) -> their outputs; None: run_experts (expert parallel)
        self.register_buffer("expert_bias", None)
        self.routed_tokens = None
        self.aux_loss = torch.zeros(())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.expert_bias is None and prefix + "expert_bias" in state_dict:  # weights trained with the bias
            self.expert_bias = torch.zeros(self.config.num_experts, dtype=torch.float32)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def reduce_router_stats(self, t):
        """Hook for per-sequence partial sums (B, E); context parallel all-reduces them over its group."""
        return t

    def dispatch(self, x_flat, topk_idx, topk_weight):
        """sum_k weight_k * expert_k(x) per token: the token slots sorted by expert, then `experts_fn` on their rows."""
        top_k = topk_idx.shape[-1]
        flat_idx = topk_idx.reshape(-1)
        order = flat_idx.argsort(stable=True)  # stable: a token's slots stay in expert order, as the old loop
        token_idx = order // top_k
        counts = torch.zeros(self.config.num_experts, dtype=torch.int32, device=x_flat.device).index_add_(
            0, flat_idx, torch.ones_like(flat_idx, dtype=torch.int32))  # on the device: no host sync
        out = (self.experts_fn or self.run_experts)(x_flat[token_idx], counts)
        out = out * topk_weight.reshape(-1)[order, None]
        return torch.zeros_like(x_flat).index_add_(0, token_idx, out.to(x_flat.dtype))

    def local_experts(self):
        """The experts this module holds, in order (all of them; under expert parallel this rank's share)."""
        return list(self.experts.values()) if isinstance(self.experts, nn.ModuleDict) else list(self.experts)

    def run_experts(self, rows, counts):
        """The held experts on `rows` sorted by expert, counts[i] rows each: grouped GEMMs or the loop, per
        `expert_compute` (where nobody set it, the probed choice for this call's device and dtype: a model cast to
        float64 after an fp32 forward takes the loop, grouped_mm has no float64)."""
        mode = self.expert_compute
        if mode is None:
            device_type = rows.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else rows.dtype
            mode = expert_compute_for(rows.device, dtype, rows.shape[-1], self.config.moe_intermediate_size)
        if mode == "grouped" and not self.experts_hooked():
            return self.grouped_experts(rows, counts)
        # every expert runs, even on zero rows, so DDP/FSDP see no unused parameters
        parts = rows.split(counts.tolist())  # the layer's one host sync
        return torch.cat([expert(part) for expert, part in zip(self.local_experts(), parts)])

    def experts_hooked(self):
        """An expert's projection carries a forward hook (LoRA adapters, a tracer): the grouped GEMMs would skip it, so
        the loop runs those experts' own forwards."""
        return any(linear._forward_hooks or linear._forward_pre_hooks for expert in self.local_experts()
                   for linear in (expert.gate_proj, expert.up_proj, expert.down_proj))

    def grouped_experts(self, rows, counts):
        """The held experts' SwiGLU on their rows as three grouped GEMMs; the offsets stay on the device.

        The experts' weights are stacked per call (E x 3 weight copies, small next to the GEMMs), so the state dict
        keeps MiniMind's per-expert names. Under autocast the matmuls run in its dtype, as nn.Linear's do."""
        op, device_type, experts = grouped_mm_op(), rows.device.type, self.local_experts()
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else rows.dtype
        offs = torch.cumsum(counts, 0, dtype=torch.int32)

        def stacked(name):  # (E, out, in) -> (E, in, out): rows @ weight.T per expert
            return torch.stack([getattr(e, name).weight for e in experts]).to(dtype).transpose(1, 2)
        with torch.autocast(device_type, enabled=False):  # the inputs are cast already; grouped_mm has no autocast rule
            rows = rows.to(dtype)
            gate, up = op(rows, stacked("gate_proj"), offs=offs), op(rows, stacked("up_proj"), offs=offs)
            return op(experts[0].act_fn(gate) * up, stacked("down_proj"), offs=offs)

    def forward(self, x):
        bsz, seq_len, hidden = x.shape
        num_experts, top_k = self.config.num_experts, self.config.num_experts_per_tok
        x_flat = x.reshape(-1, hidden)
        probs = F.softmax(self.gate(x_flat), dim=-1, dtype=torch.float32)  # router in fp32
        if self.expert_bias is None:
            topk_weight, topk_idx = torch.topk(probs, top_k, dim=-1)
        else:  # the bias steers the choice only; the gate weights are the unbiased probabilities
            topk_idx = torch.topk(probs + self.expert_bias, top_k, dim=-1).indices
            topk_weight = probs.gather(-1, topk_idx)
        if self.config.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        topk_weight = topk_weight.to(x.dtype)

        y = self.dispatch(x_flat, topk_idx, topk_weight)
        if self.config.n_shared_experts > 0:
            for expert in self.shared_experts:
                y = y + expert(x_flat)

        # sequence-level balance loss: aux_b = coef * E * sum_i f_bi * P_bi, averaged over sequences b
        full_len = seq_len * self.seq_len_scale
        counts = F.one_hot(topk_idx, num_experts).view(bsz, -1, num_experts).sum(dim=1).float()  # (B, E)
        if self.training and not in_backward():  # a recomputed (checkpointed) forward is not counted twice
            load = counts.detach().sum(dim=0)
            self.routed_tokens = load if self.routed_tokens is None else self.routed_tokens + load
        prob_sums = probs.view(bsz, seq_len, num_experts).sum(dim=1)  # (B, E)
        counts = self.reduce_router_stats(counts)
        prob_sums = self.reduce_router_stats(prob_sums)
        f = counts / (full_len * top_k)
        p = prob_sums / full_len
        self.aux_loss = (self.config.router_aux_loss_coef * num_experts * (f * p).sum(dim=-1)).mean()
        return y.view(bsz, seq_len, hidden)
