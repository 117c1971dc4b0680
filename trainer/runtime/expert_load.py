"""The MoE layers' per-expert load after each optimizer step: the tokens each expert received in the step (summed over
the ranks that see different tokens), its spread in the metrics record, a warning for an expert left without tokens,
and aux-loss-free balancing's bias update (DeepSeek-V3: b_i += rate * sign(mean load - load_i)).

The model counts (MOEFeedForward.routed_tokens, on the device, no host sync); this reads and resets the counts once
per step. With the bias on, one all-reduce of (layers x experts) numbers per step keeps every rank's bias equal; the
metrics read them on log steps only."""
import torch
import torch.distributed as dist

from model.moe import MOEFeedForward, expert_compute_for
from trainer.base.log import Logger

BALANCE_MODES = ("aux", "bias", "both")  # MiniMind's aux loss; the routing bias; both
DEAD_EXPERT_LOGS = 5  # logged steps in a row with no tokens before an expert is reported


def moe_layers(model_parts):
    """[(layer name, MOEFeedForward)] of this rank's model parts (a pipeline stage holds some layers)."""
    return [(name, module) for part in model_parts for name, module in part.named_modules()
            if isinstance(module, MOEFeedForward)]


def enable_expert_bias(model_parts):
    """Give every MoE layer without one a zero routing bias (fp32, a buffer: saved and resumed with the model)."""
    for _, moe in moe_layers(model_parts):
        if moe.expert_bias is None:  # weights trained with a bias keep theirs
            moe.expert_bias = torch.zeros(moe.config.num_experts, dtype=torch.float32, device=moe.gate.weight.device)


def choose_expert_compute(model_parts, device, dtype, requested="auto"):
    """Fix how every MoE layer runs its experts for this run (--expert_compute; auto: model/moe.expert_compute_for,
    probed once) and return the line that says it; None without MoE layers. Tensor parallel has set its layers to the
    loop."""
    layers = moe_layers(model_parts)
    if not layers:
        return None
    config = layers[0][1].config
    choice = requested if requested != "auto" else expert_compute_for(device, dtype, config.hidden_size,
                                                                       config.moe_intermediate_size)
    for _, moe in layers:
        moe.expert_compute = moe.expert_compute or choice
    chosen = {moe.expert_compute for _, moe in layers}
    how = {"grouped": "torch's grouped matmul, no host sync", "loop": "a loop over experts, one host sync per layer"}
    return "MoE experts: " + "; ".join(f"{how[c]} ({c})" for c in sorted(chosen)) + f", {str(dtype).split('.')[-1]}"


def before_wrap(model, plan):
    """Set-up of a MoE model before the parallel wrap: the routing bias of --router_balance bias/both (model state,
    so it is there before the wrap and the resume)."""
    if plan.model.router_balance != "aux":
        enable_expert_bias([model])


def after_wrap(model_parts, plan, dims):
    """Set-up after the wrap: how the experts run (--expert_compute, its line said) and the ExpertLoad the loop
    calls after each step."""
    line = choose_expert_compute(model_parts, plan.layout.device, plan.model.autocast_dtype or torch.float32,
                                 plan.model.expert_compute)
    if line:
        Logger(line)
    return ExpertLoad(model_parts, dims.group("dp_cp"), plan.model.router_balance, plan.model.router_bias_rate)


def take_loads(layers, group=None):
    """(layers, experts) tokens per expert since the last call, summed over `group`; resets the counts."""
    loads = torch.stack([moe.routed_tokens if moe.routed_tokens is not None
                         else torch.zeros(moe.config.num_experts, device=moe.gate.weight.device)
                         for _, moe in layers]).float()
    for _, moe in layers:
        moe.routed_tokens = None
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    return loads


def update_expert_bias(layers, loads, rate):
    """DeepSeek-V3's rule per layer: an expert below the mean load gains `rate`, one above loses it, one at it stays."""
    with torch.no_grad():
        for (_, moe), load in zip(layers, loads):
            moe.expert_bias += rate * torch.sign(load.mean() - load).to(moe.expert_bias.device)


def layer_number(name):
    """The decoder layer's number in a MoE module's name (model.layers.3.mlp -> 3)."""
    return name.split(".")[-2]


def load_fields(names, loads):
    """Record fields of a step's loads: per layer the fewest and most tokens an expert got and their coefficient of
    variation (std / mean over the experts; 0 when balanced)."""
    fields = {}
    for i, load in zip(map(layer_number, names), loads.double().cpu()):
        mean = float(load.mean())
        fields[f"expert_tokens_min/layer{i}"] = int(load.min())
        fields[f"expert_tokens_max/layer{i}"] = int(load.max())
        fields[f"expert_load_cv/layer{i}"] = float(load.std(unbiased=False)) / mean if mean > 0 else 0.0
    return fields


class ExpertLoad:
    """Called by the loop after each optimizer step, before the record reaches the sinks."""

    def __init__(self, model_parts, group, balance="aux", bias_rate=1e-3, dead_after=DEAD_EXPERT_LOGS):
        self.layers, self.group = moe_layers(model_parts), group
        self.bias_on, self.bias_rate, self.dead_after = balance in ("bias", "both"), bias_rate, dead_after
        self.empty_logs = None  # (layers, experts) logged steps in a row without tokens

    def step_end(self, step, record):
        """Update the bias (every step, when on) and add the load fields to `record` (a log step's, else None)."""
        if not self.layers:
            return
        if not self.bias_on and record is None:
            take_loads(self.layers)  # only resets: no collective off log steps
            return
        loads = take_loads(self.layers, self.group)
        if self.bias_on:
            update_expert_bias(self.layers, loads, self.bias_rate)
        if record is not None:
            record.update(load_fields([name for name, _ in self.layers], loads))
            self.warn_empty(step, loads)

    def warn_empty(self, step, loads):
        """One line per expert that received nothing for `dead_after` logged steps in a row."""
        empty = (loads == 0).cpu()
        self.empty_logs = empty.long() if self.empty_logs is None else (self.empty_logs + 1) * empty
        for layer, expert in (self.empty_logs == self.dead_after).nonzero().tolist():
            Logger(f"warning: MoE {self.layers[layer][0]} expert {expert} received no tokens in the last "
                   f"{self.dead_after} logged steps (step {step}); try --router_balance bias or both")
