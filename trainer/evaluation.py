"""Validation: the mean next-token cross-entropy over the target tokens of --eval_batches held-out micro-batches,
the same number under every layout. Under a pipeline the micro-batches go through the schedule's forward-only
pass (schedule.eval) in groups of --accumulation_steps, the last group filled up with rows without targets."""
import itertools
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from trainer.batches import shard_for_context, step_targets
from trainer.launch import local_value, world_sum
from trainer.parallel.tensor import tp_loss_context


def evaluate(trainer, eval_ds):
    """{"step", "eval_loss", "eval_ppl"} of up to --eval_batches held-out micro-batches (a collective)."""
    plan, dims = trainer.plan, trainer.dims
    sampler = DistributedSampler(eval_ds, num_replicas=plan.dp, rank=dims.dp_rank, shuffle=False, drop_last=True)
    loader = DataLoader(eval_ds, batch_size=plan.micro_batch, sampler=sampler, drop_last=True)
    batches = itertools.islice(loader, plan.eval_batches)
    for part in trainer.model_parts:
        part.eval()
    with torch.no_grad():
        if trainer.pipeline is None:
            ce_sum, count = plain_eval(trainer, batches)
        else:
            ce_sum, count = pipeline_eval(trainer, batches)
    for part in trainer.model_parts:
        part.train()
    ce_sum, count = world_sum([ce_sum, count], plan.device)
    loss = ce_sum / max(count, 1.0)
    return dict(step=trainer.progress.global_step, eval_loss=loss, eval_ppl=math.exp(min(loss, 50)))


def plain_eval(trainer, batches):
    """(CE sum, target count) of this rank's share, one micro-batch at a time."""
    plan, dims, model = trainer.plan, trainer.dims, trainer.model_parts[0]
    ce_sum = count = 0.0
    for batch in batches:
        targets = step_targets(batch[1])
        (x, t), positions = shard_for_context(dims, [batch[0].to(plan.device), targets.to(plan.device)],
                                              batch[2].to(plan.device) if len(batch) > 2 else None)
        with tp_loss_context(plan.tp > 1):
            out = model(x, position_ids=positions, shift_labels=t, num_items_in_batch=1)
        ce_sum += float(local_value(out.loss)) if dims.counts_loss else 0.0
        count += float((targets != -100).sum()) if dims.counts_items else 0.0
    return ce_sum, count


def pipeline_eval(trainer, batches):
    """(CE sum, target count) through the pipeline, --accumulation_steps micro-batches per forward-only pass."""
    plan, dims, pipeline = trainer.plan, trainer.dims, trainer.pipeline
    ce_sum = count = 0.0
    batches = list(batches)
    for start in range(0, len(batches), plan.num_microbatches):
        group = batches[start:start + plan.num_microbatches]
        filler = (group[0][0], torch.full_like(group[0][1], -100), *group[0][2:])  # no targets: counts nothing
        group += [filler] * (plan.num_microbatches - len(group))  # the schedule runs whole groups
        inputs, targets = torch.cat([b[0] for b in group]), torch.cat([step_targets(b[1]) for b in group])
        doc_positions = torch.cat([b[2] for b in group]).to(plan.device) if len(group[0]) > 2 else None
        (x, t), positions = shard_for_context(dims, [inputs.to(plan.device), targets.to(plan.device)], doc_positions)
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        positions = positions.float().expand(x.shape).contiguous()
        collected = []
        pipeline.loss_fn.forward_only = cross_entropy_sum
        try:
            if pipeline.has_last:
                pipeline.schedule.eval(*((x, positions) if pipeline.has_first else ()),
                                       target=pipeline.loss_fn.pack(t, None), losses=collected)
            else:
                pipeline.schedule.eval(*((x, positions) if pipeline.has_first else ()))
        finally:
            pipeline.loss_fn.forward_only = None
        ce_sum += float(torch.cat(collected).sum()) if collected and dims.counts_loss else 0.0
        count += float((targets != -100).sum()) if dims.counts_items else 0.0
    return ce_sum, count


def cross_entropy_sum(logits, targets):
    """The last stage's forward-only value of a micro-batch: its summed CE (fp32), shape (1,)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100,
                           reduction="sum").reshape(1)
