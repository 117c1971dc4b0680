"""Pipeline parallelism: split a plain MiniMindForCausalLM into stages for torch.distributed.pipelining.

Each pp rank keeps the layers of its stage(s) (contiguous, balanced ranges) under the same attribute
paths as the full model, so parameter FQNs (`model.layers.3.mlp...`) are unchanged for checkpoints,
tensor-parallel plans and optimizers. Schedules: GPipe, 1F1B, and interleaved 1F1B with 2 virtual
stages per rank (stage ids rank and rank + pp).

The first stage takes `(input_ids, positions)`; stage i -> i+1 carries `(hidden_states, aux, positions)`,
`aux` a shape-(1,) float32 running sum of the MoE layers' sequence-level aux losses for the micro-batch
(zero for dense models), `positions` the micro-batch's (samples, tokens) position ids as float32 (context
parallel's global positions, or per-document positions of packed rows, which also give the document mask).
The last stage returns `(logits, aux)` and `PipelineLoss` turns it into `ce_sum / num_items + aux * aux_weight`.

Tied embeddings: with tie_word_embeddings, `lm_head.weight is model.embed_tokens.weight`. The first
stage owns embed_tokens, the last stage lm_head; when they sit on different ranks each rank keeps its
own copy of the one weight. `sync_tied_grads` sums the two copies' gradients (point-to-point between
the first and last rank) after backward, so both copies see the full gradient and identical optimizer
updates keep them equal. Count that weight once in a global grad norm (`params_for_grad_norm`).

Stage shapes are given to PipelineStage up front (`stage_io_examples`): every micro-batch is
(micro_batch, seq_len) tokens. Left to infer them, torch 2.13 runs each stage once on uninitialised
inputs; MoE routing on that garbage differs between tensor-parallel ranks, whose expert all-reduces
then disagree in size and hang (older torch inferred on zeros, which routes alike everywhere).
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from model.model_minimind import packed_document_mask
from trainer.base.launch import add_stats

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}



def validate(args, config, zero_stage):
    """The dimension's check (parallel/mesh.py DIMENSIONS): one line saying what to change, else None."""
    return pp_validate(config.num_hidden_layers, args.pp, args.pp_schedule, args.accumulation_steps)


# ----------------------------------------------------------------------------- layout and validation
def pipeline_stage_ranges(num_layers, num_stages):
    """Contiguous, balanced [start, end) layer ranges, one per stage; earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def pp_validate(num_layers, pp_size, schedule, num_microbatches):
    """None when the pipeline layout is valid, else one line saying what to change."""
    if schedule not in SCHEDULES:
        return f"--pp_schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}"
    num_stages = pp_size * VIRTUAL_STAGES[schedule]
    if num_layers < num_stages:
        return (f"{schedule} with pp={pp_size} needs >= {num_stages} layers (one per stage), model has "
                f"{num_layers}; lower --pp or use more layers")
    # every schedule: pre-2.13 torch's single-stage schedules (GPipe too) reject fewer micro-batches than stages
    if num_microbatches < pp_size:
        return (f"{schedule} needs >= pp={pp_size} micro-batches per step, got {num_microbatches}; "
                "raise the micro-batch count")
    rounds = max(1, num_microbatches // pp_size)
    if schedule == "interleaved1f1b" and num_microbatches % rounds:
        return (f"interleaved1f1b needs the micro-batch count ({num_microbatches}) to be a multiple of "
                f"micro-batches // pp = {rounds}; use a multiple of pp={pp_size}")
    return None


# ----------------------------------------------------------------------------- stage module
class PipelineStageModule(nn.Module):
    """Layers [start, end) of a MiniMindForCausalLM, holding the same submodules under the same names.

    forward: first stage `(input_ids, positions) -> (hidden, aux, positions)`, middle
    `(hidden, aux, positions) -> (hidden, aux, positions)`, last `(hidden, aux, positions) -> (logits, aux)`.
    """

    def __init__(self, model, start, end, is_first, is_last):
        super().__init__()
        inner = model.model
        self.model = nn.Module()  # container so names read `model.<...>` like the full model
        if is_first:
            self.model.embed_tokens = inner.embed_tokens
            self.model.dropout = inner.dropout
        # a ModuleDict keyed by str(i) gives the same FQNs as the full model's ModuleList
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(start, end)})
        self.model.rotary_emb = inner.rotary_emb
        if is_last:
            self.model.norm = inner.norm
            self.lm_head = model.lm_head
        self.layer_range, self.is_first, self.is_last = (start, end), is_first, is_last
        self.tied = model.lm_head.weight is inner.embed_tokens.weight
        self.document_mask = packed_document_mask  # as MiniMindModel's: context parallel swaps it
        self.autocast_dtype = None  # bf16/fp16: the stage runs under torch.autocast (the schedule calls forward)

    def forward(self, x, *carried):
        device_type = x.device.type
        with torch.autocast(device_type, self.autocast_dtype) if self.autocast_dtype else nullcontext():
            return self._forward(x, *carried)

    def _forward(self, x, *carried):
        if self.is_first:
            (positions,) = carried
            hidden = self.model.dropout(self.model.embed_tokens(x))
            # grad-requiring start values keep aux and positions differentiable on every stage (uniform p2p)
            aux = torch.zeros(1, device=hidden.device, dtype=torch.float32, requires_grad=torch.is_grad_enabled())
            positions = positions.float().detach().requires_grad_(torch.is_grad_enabled())
        else:
            hidden, (aux, positions) = x, carried
        position_ids = positions.detach().long()
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        mask = self.document_mask(position_ids)  # packed rows: their documents; parallelize sets none without
        for layer in self.model.layers.values():
            hidden = layer(hidden, position_embeddings, mask)
            layer_aux = getattr(layer.mlp, "aux_loss", None)
            if torch.is_tensor(layer_aux):
                aux = aux + layer_aux.float().reshape(1)
        if self.is_last:
            # 0 * positions: the received positions get a (zero) gradient to send back, as every input does
            return self.lm_head(self.model.norm(hidden)), aux + 0.0 * positions.sum()
        return hidden, aux, positions * 1.0


# ----------------------------------------------------------------------------- loss
class PipelineLoss:
    """Last-stage loss_fn(output, targets) for the schedule: `(main + aux * aux_weight) * grad_scale`, then scaled by
    `scaler` (a torch.amp.GradScaler, fp16) as the non-pipeline path's scaler.scale(loss) does.

    main: the objective's share of the step's mean (trainer/plan/objective.py; LM: ce_sum / num_items, num_items the
    step's target tokens over all dp ranks); aux_weight: micro-batch samples / global samples; grad_scale: the dp*cp
    factor when gradients are averaged. Update the attributes before each step. Records each micro-batch's main
    loss, weighted aux and stats for logging; read them with `pop_step`. The objective's extra tensors (one entry
    per row, e.g. DPO's reference log-probs) ride behind the targets (`pack`): the schedule calls the loss once per
    micro-batch with that micro-batch's slice of the targets, so each loss gets its own extras, in any schedule.
    """

    def __init__(self, num_items=1, aux_weight=0.0, grad_scale=1.0, scaler=None, objective=None):
        self.num_items, self.aux_weight, self.grad_scale, self.scaler = num_items, aux_weight, grad_scale, scaler
        self.objective = objective  # the stage's (plan/objective.py); the parallel layer never builds one
        self.ce_parts, self.aux_parts, self.stats_parts = [], [], []
        self.extra_layout = []  # (dtype, shape of one row) of each extra tensor packed behind the targets
        self.forward_only = None  # fn(logits, targets) -> what schedule.eval collects per micro-batch, or None

    def pack(self, targets, extras):
        """The step's targets (rows, L) with the objective's extras appended as float64 bits (one entry per row, given
        per micro-batch), so the schedule cuts both into the same micro-batches; `__call__` unpacks them."""
        self.extra_layout = []
        if not extras or not extras[0]:
            return targets
        columns = [targets]
        for k in range(len(extras[0])):
            extra = torch.cat([micro[k] for micro in extras])
            self.extra_layout.append((extra.dtype, extra.shape[1:]))
            columns.append(extra.to(torch.float64).reshape(targets.shape[0], -1).view(torch.int64))
        return torch.cat(columns, dim=1)

    def unpack(self, targets):
        """(targets, extra tensors) of one micro-batch's packed targets."""
        end, extra = targets.shape[1], []
        for dtype, shape in reversed(self.extra_layout):
            width = shape.numel()
            bits = targets[:, end - width:end].contiguous()
            extra.insert(0, bits.view(torch.float64).to(dtype).reshape(targets.shape[0], *shape))
            end -= width
        return targets[:, :end], tuple(extra)

    def __call__(self, output, targets):
        logits, aux = output
        targets, extra = self.unpack(targets)
        if self.forward_only is not None:  # schedule.eval(): no loss, no backward
            return self.forward_only(logits, targets)
        ce, stats = self.objective.pipeline_loss(logits, targets, extra, self.num_items)
        weighted_aux = aux.sum() * self.aux_weight
        self.ce_parts.append(ce.detach())
        self.aux_parts.append(weighted_aux.detach())
        self.stats_parts.append(stats)
        loss = (ce + weighted_aux) * self.grad_scale
        return loss if self.scaler is None else self.scaler.scale(loss)

    def pop_step(self, num_microbatches):
        """(sum of main parts, sum of weighted aux parts, stats summed) of the last step's micro-batches; clears the
        record. Only the last `num_microbatches` records count: torch >= 2.13 also calls the loss once while
        inferring shapes on the first step.
        """
        ce = torch.stack(self.ce_parts[-num_microbatches:]).sum()
        aux = torch.stack(self.aux_parts[-num_microbatches:]).sum()
        stats = {}
        for part in self.stats_parts[-num_microbatches:]:
            add_stats(stats, part)
        self.ce_parts, self.aux_parts, self.stats_parts = [], [], []
        return ce, aux, stats


# ----------------------------------------------------------------------------- schedule
def split_model(model, pp_group, schedule_name):
    """This pp rank's stage modules (sharing parameters with `model`) and their stage ids."""
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    num_stages = pp_size * VIRTUAL_STAGES[schedule_name]
    ranges = pipeline_stage_ranges(len(model.model.layers), num_stages)
    stage_ids = list(range(pp_rank, num_stages, pp_size))  # rank r holds r, r+pp, ... (torch's layout)
    modules = [PipelineStageModule(model, *ranges[s], s == 0, s == num_stages - 1) for s in stage_ids]
    return modules, stage_ids, num_stages


def stage_io_examples(module, micro_batch, seq_len, hidden_size, vocab_size, logits_dtype=torch.float32):
    """(input_args, output_args) meta tensors of one micro-batch through `module` (a PipelineStageModule).

    Inputs: (token ids, positions) on the first stage, else (hidden, aux, positions); outputs: (hidden, aux,
    positions), or (logits, aux) on the last stage (full vocab: under a pipeline tp gathers the logits). Hidden
    states stay fp32 under autocast (fp32 residual stream); the logits take the autocast dtype.
    """
    def meta(*shape, dtype=torch.float32, grad=True):
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)
    positions = meta(micro_batch, seq_len)
    if module.is_first:
        inputs = (meta(micro_batch, seq_len, dtype=torch.long, grad=False), meta(micro_batch, seq_len, grad=False))
    else:
        inputs = (meta(micro_batch, seq_len, hidden_size), meta(1), positions)
    if module.is_last:
        return inputs, (meta(micro_batch, seq_len, vocab_size, dtype=logits_dtype), meta(1))
    return inputs, (meta(micro_batch, seq_len, hidden_size), meta(1), positions)


def make_schedule(parts, stage_ids, num_stages, schedule_name, num_microbatches, loss_fn, device, pp_group,
                  micro_batch_shape, config, autocast_dtype=None):
    """PipelineStages over the (possibly TP/DP-wrapped) stage modules, and the schedule driving them.

    micro_batch_shape: (samples, tokens) of every micro-batch on this rank (tokens after context
    parallel's split); the stages get their shapes from it instead of inferring them on the first step.
    """
    stages = []
    for part, stage_id in zip(parts, stage_ids):
        module = getattr(part, "module", part)  # DDP keeps the stage module under .module
        module.autocast_dtype = autocast_dtype
        inputs, outputs = stage_io_examples(module, *micro_batch_shape, config.hidden_size, config.vocab_size,
                                            autocast_dtype or torch.float32)
        stages.append(PipelineStage(part, stage_id, num_stages, torch.device(device), input_args=inputs,
                                    output_args=outputs, group=pp_group))
    stage_arg = stages if schedule_name == "interleaved1f1b" else stages[0]
    # scale_grads=False: the loss is already normalised by the step's token count
    return SCHEDULES[schedule_name](stage_arg, num_microbatches, loss_fn=loss_fn, scale_grads=False)


class Pipeline:
    """What the trainer needs of pipeline parallelism: the split, the schedule, the step, forward-only passes (held-out
    loss, scoring forwards), tied weights."""

    def __init__(self, model, pp_group, schedule_name, num_microbatches, device, micro_batch_shape,
                 autocast_dtype=None):
        self.pp_group, self.schedule_name, self.device = pp_group, schedule_name, device
        self.num_microbatches, self.micro_batch_shape = num_microbatches, micro_batch_shape
        self.config, self.autocast_dtype = model.config, autocast_dtype
        self.stage_modules, self.stage_ids, self.num_stages = split_model(model, pp_group, schedule_name)
        self.has_first = self.stage_modules[0].is_first
        self.has_last = self.stage_modules[-1].is_last
        self.loss_fn = PipelineLoss()
        self.schedule = None

    def make_schedule(self, parts):
        self.schedule = make_schedule(parts, self.stage_ids, self.num_stages, self.schedule_name,
                                      self.num_microbatches, self.loss_fn, self.device, self.pp_group,
                                      self.micro_batch_shape, self.config, self.autocast_dtype)
        return self.schedule

    def step(self, input_ids, targets, position_ids, num_items, aux_weight, grad_scale, scaler, objective,
             extras=None):
        """Forward+backward of one optimizer step: `input_ids`/`targets` are the step's micro-batches
        stacked along the batch (already sharded for context parallel). `position_ids`: (samples or 1, tokens),
        this rank's context-parallel positions or packed rows' per-document ones; None means 0..L-1.
        scaler: the step's GradScaler (fp16), which then unscales gradients the scaled loss made.
        objective: the stage's (trainer/plan/objective.py); extras: its per-micro-batch extra
        tensors. Returns (main loss, aux, stats) summed over the micro-batches (zeros and {} off the last stage)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = position_ids.float().expand(input_ids.shape).contiguous()  # chunked per micro-batch with the ids
        self.loss_fn.num_items, self.loss_fn.aux_weight, self.loss_fn.grad_scale = num_items, aux_weight, grad_scale
        self.loss_fn.scaler, self.loss_fn.objective = scaler, objective
        if scaler is not None and not self.has_last:  # unscale_ needs the scale where no loss was scaled
            scaler.scale(torch.ones((), device=self.device))
        targets = self.loss_fn.pack(targets, extras)  # an objective's extras travel with their micro-batch's targets
        pipeline_step(self.schedule, (input_ids, positions), targets, self.has_first, self.has_last)
        if not self.has_last:
            return torch.zeros(()), torch.zeros(()), {}
        return self.loss_fn.pop_step(self.num_microbatches)

    def forward_only(self, input_ids, targets, score, positions=None):
        """Forward only through the schedule (schedule.eval, torch >= 2.9) over stacked micro-batches: the last stage
        returns each micro-batch's `score(logits, targets)`, which the schedule collects (concatenated here); None on
        the other stages. positions: the rows' position ids (default 0..L-1), carried from stage to stage."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions.float().expand(input_ids.shape).contiguous()
        collected = []
        self.loss_fn.forward_only = score
        args = (input_ids, positions) if self.has_first else ()
        try:
            if self.has_last:
                self.schedule.eval(*args, target=self.loss_fn.pack(targets, None), losses=collected)
                return torch.cat(collected)
            self.schedule.eval(*args)
            return None
        finally:
            self.loss_fn.forward_only = None  # the pipeline trains again after a forward-only pass

    def eval_sum(self, batches, score, shard):
        """The sum of `score(logits, targets)` over held-out micro-batches, num_microbatches per forward-only pass (the
        schedule runs whole groups: the last is filled up with rows without targets); 0.0 off the last stage.

        batches: (input_ids, targets, position ids or None) CPU tensors per micro-batch, targets already shifted;
        shard(tensors, positions) -> (tensors, positions): this rank's part of the sequence (context parallel)."""
        total = 0.0
        for start in range(0, len(batches), self.num_microbatches):
            group = batches[start:start + self.num_microbatches]
            filler = (group[0][0], torch.full_like(group[0][1], -100), group[0][2])  # no targets: scores nothing
            group += [filler] * (self.num_microbatches - len(group))
            inputs, targets = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
            doc_positions = None if group[0][2] is None else torch.cat([b[2] for b in group]).to(self.device)
            (x, t), positions = shard([inputs.to(self.device), targets.to(self.device)], doc_positions)
            values = self.forward_only(x, t, score, positions)
            total += float(values.sum()) if values is not None else 0.0
        return total

    def sync_tied_grads(self):
        sync_tied_grads(self.stage_modules, self.pp_group)

    def duplicate_params(self):
        """Parameters to leave out of the global grad norm (the last stage's tied lm_head copy)."""
        counted = {id(p) for p in params_for_grad_norm(self.stage_modules)}
        return [p for m in self.stage_modules for p in m.parameters() if id(p) not in counted]


def pipeline_step(schedule, inputs, targets, has_first_stage, has_last_stage):
    """One forward+backward of all micro-batches; `inputs` are the first stage's (input_ids, positions).
    Returns the per-micro-batch losses (empty off the last stage)."""
    losses = []
    args = tuple(inputs) if has_first_stage else ()
    schedule.step(*args, target=targets if has_last_stage else None, losses=losses if has_last_stage else None)
    return losses


# ----------------------------------------------------------------------------- tied embeddings
def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor (TP/FSDP): its local shard


def sync_tied_grads(stage_modules, pp_group):
    """Sum the tied embed_tokens / lm_head gradient over the first and last pp rank (after backward, before clipping).

    No-op for untied weights, on middle ranks, and when one rank holds both ends (one shared Parameter).
    """
    if isinstance(pp_group, DeviceMesh):
        pp_group = pp_group.get_group()
    first = next((m for m in stage_modules if m.is_first), None)
    last = next((m for m in stage_modules if m.is_last), None)
    if (first is None) == (last is None) or not stage_modules[0].tied:
        return
    weight = first.model.embed_tokens.weight if first is not None else last.lm_head.weight
    if not weight.requires_grad:  # frozen (a LoRA base): no gradient to exchange
        return
    peer = dist.get_world_size(pp_group) - 1 if first is not None else 0
    peer = dist.get_global_rank(pp_group, peer)
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    if getattr(weight.grad, "placements", None) not in (None, getattr(weight, "placements", None)):
        # tp: the embedding's grad may come back Replicate; both ends must exchange the same shard
        weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
    grad = _local(weight.grad)
    received = torch.empty_like(grad)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grad, peer, pp_group),
                                    dist.P2POp(dist.irecv, received, peer, pp_group)])
    for work in works:
        work.wait()
    grad.add_(received)  # a + b == b + a in IEEE: both copies get bit-identical gradients


def params_for_grad_norm(stage_modules):
    """This rank's parameters to count in a global grad norm: the last stage's tied lm_head copy is skipped
    (the first stage counts it), and a parameter shared by two local stages is listed once."""
    has_first = any(m.is_first for m in stage_modules)
    seen, params = set(), []
    for module in stage_modules:
        skip = module.lm_head.weight if (module.is_last and module.tied and not has_first) else None
        for p in module.parameters():
            if p is not skip and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params
