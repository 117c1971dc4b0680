"""Validation through the stage's objective: its held-out loss (LM: the mean next-token cross-entropy over the target
tokens) of --eval_batches micro-batches, the same number under every layout. Under a pipeline the micro-batches go
through the schedule's forward-only pass (schedule.eval) in groups of --accumulation_steps, the last group filled up
with rows without targets."""
import itertools
import math
from functools import partial

import torch
from torch.utils.data import DataLoader, DistributedSampler

from dataset.mixture import leaf_datasets
from trainer.base.launch import full_value, world_sum
from trainer.core.batches import loss_context, shard_for_context, step_targets
from trainer.core.data_loading import row_collate
from trainer.judge.units import bits_per_byte, target_bytes, token_byte_lengths


def evaluate(trainer, eval_ds):
    """{"step", "eval_loss", "eval_ppl", "eval_bpb"} of up to --eval_batches held-out micro-batches (a collective): the
    objective's summed eval loss over its count of items (LM: target tokens); bits per byte: the summed CE in nats over
    ln 2 x the UTF-8 bytes of the target tokens (trainer/judge/units.py), comparable across tokenizers."""
    plan, dims = trainer.plan, trainer.dims
    sampler = DistributedSampler(eval_ds, num_replicas=plan.layout.dp, rank=dims.rank("dp"), shuffle=False,
                                 drop_last=True)
    loader = DataLoader(eval_ds, batch_size=plan.data.micro_batch, sampler=sampler, drop_last=True,
                        collate_fn=row_collate(plan, eval_ds))
    batches = [trainer.objective.unpack(batch) for batch in itertools.islice(loader, plan.data.eval_batches)]
    for part in trainer.model_parts:
        part.eval()
    with torch.no_grad():
        if trainer.pipeline is None:
            loss_sum, count = plain_eval(trainer, batches)
        else:
            loss_sum, count = pipeline_eval(trainer, batches)
    for part in trainer.model_parts:
        part.train()
    tokenizer = next((d.tokenizer for d in leaf_datasets(eval_ds) if hasattr(d, "tokenizer")), None)
    num_bytes = float(sum(target_bytes(token_byte_lengths(tokenizer), step_targets(labels)) for _, labels, _, _ in
                          batches)) if tokenizer is not None and trainer.dims.counts_items else 0.0
    loss_sum, count, num_bytes = world_sum([loss_sum, count, num_bytes], plan.layout.device)
    loss = loss_sum / max(count, 1.0)
    bpb = bits_per_byte(loss_sum, num_bytes)
    return dict(step=trainer.progress.global_step, eval_loss=loss, eval_ppl=math.exp(min(loss, 50)),
                **({"eval_bpb": bpb} if bpb is not None else {}))


def plain_eval(trainer, batches):
    """(loss sum, item count) of this rank's share, one micro-batch at a time."""
    plan, dims, model, objective = trainer.plan, trainer.dims, trainer.model_parts[0], trainer.objective
    loss_sum = count = 0.0
    for input_ids, labels, positions, extra in batches:
        targets = step_targets(labels)
        (x, t), positions = shard_for_context(dims, [input_ids.to(plan.layout.device), targets.to(plan.layout.device)],
                                              None if positions is None else positions.to(plan.layout.device))
        with loss_context(plan.layout.tp):
            loss = objective.eval_loss(model, x, t, positions, tuple(e.to(plan.layout.device) for e in extra))
        loss_sum += float(full_value(loss)) if dims.counts_loss else 0.0
        count += float(objective.count(labels, extra)) if dims.counts_items else 0.0
    return loss_sum, count


def pipeline_eval(trainer, batches):
    """(loss sum, item count) through the pipeline's forward-only passes (trainer/parallel/pipeline.py
    Pipeline.eval_sum: --accumulation_steps micro-batches per pass)."""
    dims, objective = trainer.dims, trainer.objective
    rows = [(input_ids, step_targets(labels), positions) for input_ids, labels, positions, _ in batches]
    loss_sum = trainer.pipeline.eval_sum(rows, objective.eval_pipeline_loss, partial(shard_for_context, dims))
    count = float(sum(objective.count(labels, extra) for _, labels, _, extra in batches))
    return loss_sum if dims.counts_loss else 0.0, count if dims.counts_items else 0.0
