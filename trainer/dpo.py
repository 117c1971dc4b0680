"""DPO (sigmoid, Rafailov et al.): the stage plan, the preference objective and the reference log-probs.

loss = -logsigmoid(beta * ((pc - rc) - (pr - rr))), averaged over the step's pairs, where pc / pr are the policy's
summed log-probs of the chosen / rejected assistant tokens (SFT's labels) and rc / rr the reference model's.
The reference's sums are computed once before training, in the training layout, with the reference model
loaded alone and dropped after (so no second model lives beside the policy), and cached beside the token cache;
the dataset hands them out with each pair (dataset/lm_dataset.py DPODataset).
"""
import gc
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from model.weights import atomic_save
from trainer.checks import other_sizes
from trainer.config import weight_path
from trainer.launch import ConfigError, count_sum, is_main_process, setup_seed
from trainer.objective import LMObjective
from trainer.parallel.parallelize import parallelize
from trainer.parallel.tensor import tp_loss_context
from trainer.train_loop import autocast, leaf_datasets, step_targets
from trainer.trainer_utils import Logger, init_model

DEFAULT_BETA = 0.15  # MiniMind's train_dpo.py
LOG_PROB_CHUNK = 1024  # rows of logits turned into fp32 log-softmax at a time
REFERENCE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class DPOPlan:
    """The DPO stage's checked flags."""
    beta: float
    ref_weight: str  # the reference model's weights (a .pth, a step_<N> checkpoint, an HF folder), or "none"
    ref_identity: str  # what the reference log-probs depend on besides the data: weights file(s), model, dtype
    rows_per_sample: int = 2  # a sample is a chosen/rejected pair: two model rows (pipeline stage shapes)


def resolve_dpo(args, plan):
    """Check DPO's flags against the TrainPlan; ConfigError (one line) on bad input."""
    if not args.beta > 0:
        raise ConfigError(f"--beta must be > 0 (MiniMind uses {DEFAULT_BETA}), got {args.beta}")
    if plan.cp > 1:
        raise ConfigError("DPO does not run with --cp > 1 (its per-sequence log-prob sums would need a "
                          "context-parallel reduction); use --tp or --pp for long rows")
    if plan.packing:
        raise ConfigError("--packing 1: DPO keeps each chosen/rejected conversation in its own row; leave it out")
    if plan.eval_data_path:
        raise ConfigError("--eval_data_path: DPO logs its rewards instead of a held-out LM loss; leave it out")
    ref_weight = (plan.from_weight if args.ref_weight is None
                  else weight_path(args.ref_weight, plan.save_dir, plan.model_config))
    if ref_weight != "none" and not os.path.exists(ref_weight):
        raise ConfigError(f"--ref_weight {ref_weight} does not exist; {other_sizes(ref_weight, '--ref_weight')}"
                          "pass a .pth, a resume checkpoint step_<N> "
                          "directory or a Hugging Face folder")
    return DPOPlan(beta=float(args.beta), ref_weight=ref_weight, ref_identity=reference_identity(ref_weight, plan))


def reference_identity(ref_weight, plan):
    """A digest of the reference model: its files (path, size, mtime), or the seeded init; the model and dtype."""
    files = []
    if ref_weight == "none":
        files.append(["seed", plan.seed])
    elif os.path.isdir(ref_weight):
        for root, _, names in sorted(os.walk(ref_weight)):
            for name in sorted(names):
                stat = os.stat(os.path.join(root, name))
                files.append([os.path.join(root, name), stat.st_size, stat.st_mtime_ns])
    elif os.path.exists(ref_weight):
        stat = os.stat(ref_weight)
        files.append([os.path.abspath(ref_weight), stat.st_size, stat.st_mtime_ns])
    key = [REFERENCE_FORMAT_VERSION, files, plan.model_config.to_dict(), str(plan.dtype)]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- log-probs of the targets

class _TargetLogProbs(torch.autograd.Function):
    """log softmax(logits)[target] per row, in fp32 chunks of rows; backward recomputes each chunk's softmax.

    Only the logits (the model's output, in its dtype) are kept for backward, never a full fp32 copy of them.
    """

    @staticmethod
    def forward(ctx, logits, targets, chunk_size):
        out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        valid = targets != -100
        safe = torch.where(valid, targets, 0)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
            out[rows] = log_probs.gather(1, safe[rows, None]).squeeze(1)
        out = out * valid
        ctx.save_for_backward(logits, safe, valid)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, safe, valid = ctx.saved_tensors
        grad = torch.empty_like(logits)
        weights = (grad_out * valid).float()
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            w = weights[rows, None]
            chunk = torch.softmax(logits[rows].float(), dim=-1).mul_(-w)  # d log p_t / d z = onehot(t) - softmax
            chunk.scatter_add_(1, safe[rows, None], w)
            grad[rows] = chunk.to(logits.dtype)
        return grad, None, None


def sequence_log_probs(logits, targets, chunk_size=LOG_PROB_CHUNK):
    """Summed log-probs of each row's targets (-100: none): logits (N, L, V), targets (N, L) -> (N,) fp32.

    Vocab-sharded DTensor logits (tensor parallel, under loss_parallel()) go through cross_entropy with
    reduction="none", which loss_parallel supports: log p = -CE.
    """
    rows, length = targets.shape
    if hasattr(logits, "placements"):
        per_token = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                     reduction="none")
        per_token = per_token.full_tensor() if hasattr(per_token, "full_tensor") else per_token
    else:
        per_token = _TargetLogProbs.apply(logits.flatten(0, 1), targets.flatten(), chunk_size)
    return per_token.view(rows, length).sum(dim=1)


def pair_losses(log_probs, reference, beta):
    """Per-pair DPO losses and reward sums from policy log-probs (2B,) (pairs interleaved, chosen first) and
    the reference's (B, 2). Returns (loss sum, stats: sums of TRL's rewards/* over the pairs, detached)."""
    policy = log_probs.float().view(-1, 2)
    rewards = beta * (policy - reference.float().view(-1, 2))  # TRL's rewards/chosen, rewards/rejected
    margins = rewards[:, 0] - rewards[:, 1]
    losses = -F.logsigmoid(margins)
    detached = rewards.detach()
    stats = {"chosen_reward_sum": detached[:, 0].sum(), "rejected_reward_sum": detached[:, 1].sum(),
             "accuracy_sum": (margins.detach() > 0).float().sum(), "margin_sum": margins.detach().sum()}
    return losses.sum(), stats


# ----------------------------------------------------------------------------- the objective

class DPOObjective(LMObjective):
    """The preference loss for trainer/train_loop.py's train_step (see trainer/objective.py for the methods)."""

    stat_names = ("chosen_reward_sum", "rejected_reward_sum", "accuracy_sum", "margin_sum")
    items_are_tokens = False  # count() gives pairs

    def __init__(self, beta):
        self.beta = beta

    def unpack(self, batch):
        """(B, 2, L) pairs -> (2B, L) rows, chosen and rejected of a pair adjacent; extra: the reference's log-prob of
        each row (2B, 1), so that a pipeline cuts it into micro-batches with the rows."""
        input_ids, labels, reference = batch
        return input_ids.flatten(0, 1), labels.flatten(0, 1), None, (reference.reshape(-1, 1),)

    def count(self, labels, extra):
        return labels.shape[0] // 2  # pairs

    def log_probs(self, model, input_ids, targets, position_ids=None):
        """Summed log-probs of each row's targets under `model` (a plain or tensor-parallel model)."""
        out = model(input_ids, position_ids=position_ids)
        return sequence_log_probs(out.logits, targets), out.aux_loss

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        log_probs, aux_loss = self.log_probs(model, input_ids, targets, position_ids)
        loss_sum, stats = pair_losses(log_probs, extra[0], self.beta)
        return loss_sum / num_items, aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        loss_sum, stats = pair_losses(sequence_log_probs(logits, targets), extra[0], self.beta)
        return loss_sum / num_items, stats

    def record(self, stats, num_items):
        """TRL's names: the mean rewards of the chosen and rejected answers, how often chosen wins, the margin."""
        pairs = max(num_items, 1)
        return {"rewards/chosen": stats["chosen_reward_sum"] / pairs,
                "rewards/rejected": stats["rejected_reward_sum"] / pairs,
                "rewards/accuracies": stats["accuracy_sum"] / pairs, "rewards/margins": stats["margin_sum"] / pairs}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The model's training FLOPs, its lm_head on every position: the log-probs come from the full logits."""
        return super().flops(config, seq_len, positions, target_tokens, False)


# ----------------------------------------------------------------------------- the reference log-probs

def attach_reference(plan, dims, train_ds, objective):
    """Give every DPODataset under `train_ds` its reference log-probs (set_reference): read from the cache, or
    computed once in this layout by the reference model, which is then dropped, and cached by rank 0.

    Every rank computes its data-parallel share; the shares are summed over all ranks, so every rank holds
    the same values, whether or not it can read the file rank 0 writes."""
    datasets = leaf_datasets(train_ds)
    paths = [reference_cache_path(ds, plan.stage.ref_identity) for ds in datasets]
    if count_sum(int(not all(os.path.exists(p) for p in paths))):  # one rank missing one: all compute them all
        Logger(f"reference log-probs: computing them with {plan.stage.ref_weight} (once; cached beside the tokens)")
        model_parts, pipeline = load_reference(plan, dims)
        values = [reference_log_probs(model_parts, pipeline, ds, plan, dims, objective) for ds in datasets]
        del model_parts, pipeline
        release_memory(plan)
        for path, value in zip(paths, values):
            if is_main_process():
                atomic_save(torch.from_numpy(value), path)
    else:
        values = [torch.load(path, weights_only=True).numpy() for path in paths]
    for ds, value in zip(datasets, values):
        ds.set_reference(value)


def reference_cache_path(ds, ref_identity):
    """<token cache dir>/<data file>.dpo_ref.<digest>.pt, keyed by the pairs' tokens and the reference model."""
    key = json.dumps([REFERENCE_FORMAT_VERSION, ds.cache_key(), ref_identity])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(ds.chosen.cache_path), f"{os.path.basename(ds.data_path)}.dpo_ref.{digest}.pt")


def load_reference(plan, dims):
    """The reference model in the training layout, eval mode; the RNG is reseeded after, so that a seeded policy
    init (--from_weight none) equals a seeded reference."""
    setup_seed(plan.seed)
    model = init_model(plan.model_config, plan.stage.ref_weight).to(plan.device).eval()
    model_parts, pipeline = parallelize(model, dims, plan)
    setup_seed(plan.seed)
    return model_parts, pipeline


def release_memory(plan):
    gc.collect()
    if plan.device.startswith("cuda"):
        torch.cuda.empty_cache()


def reference_log_probs(model_parts, pipeline, ds, plan, dims, objective):
    """(len(ds), 2) float64 summed log-probs of every pair under the reference model, on every rank.

    dp rank r takes pairs [r * share, (r + 1) * share) in batches of one optimizer step's micro-batches (pipeline)
    or one micro-batch; every rank runs the same number of batches (data-parallel wrappers gather in forward)."""
    n, rows = len(ds), plan.micro_batch * (plan.num_microbatches if pipeline is not None else 1)
    share = -(-n // plan.dp)
    positions = dims.dp_rank * share + np.arange(-(-share // rows) * rows)
    keep = (positions < min(n, (dims.dp_rank + 1) * share)) & dims.counts_items  # who holds a pair's value
    values = torch.zeros(n, 2, dtype=torch.float64)
    for start in tqdm(range(0, len(positions), rows), desc="reference log-probs", unit="batch", delay=1,
                      disable=not is_main_process(), dynamic_ncols=True):  # its own bar, with ETA, before training
        index = positions[start:start + rows] % n
        pairs = [ds[int(i)] for i in index]
        input_ids = torch.stack([p[0] for p in pairs]).flatten(0, 1).to(plan.device)
        targets = step_targets(torch.stack([p[1] for p in pairs]).flatten(0, 1)).to(plan.device)
        with torch.no_grad():
            log_probs = forward_log_probs(model_parts, pipeline, input_ids, targets, plan, objective)
        held = keep[start:start + rows]
        if held.any():
            values[index[held]] = log_probs.view(-1, 2).double().cpu()[torch.from_numpy(held)]
    if dist.is_initialized():
        values = values.to(plan.device)
        dist.all_reduce(values)  # each pair is held by exactly one rank: the sum is that rank's value
    return values.cpu().numpy()


def forward_log_probs(model_parts, pipeline, input_ids, targets, plan, objective):
    """(rows,) summed target log-probs; through the pipeline's forward-only schedule when pp > 1 (zeros off the
    last stage)."""
    if pipeline is None:
        with tp_loss_context(plan.tp > 1), autocast(plan):
            return objective.log_probs(model_parts[0], input_ids, targets)[0]
    return pipeline_log_probs(pipeline, input_ids, targets)


def pipeline_log_probs(pipeline, input_ids, targets):
    """Forward only through the pipeline's schedule (schedule.eval, torch >= 2.9): the last stage's loss function
    returns each micro-batch's summed log-probs, which the schedule collects; zeros on the other stages."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).float().expand(input_ids.shape)
    collected = []
    pipeline.loss_fn.forward_only = sequence_log_probs
    args = (input_ids, positions.contiguous()) if pipeline.has_first else ()
    if pipeline.has_last:
        pipeline.schedule.eval(*args, target=pipeline.loss_fn.pack(targets, None), losses=collected)
        return torch.cat(collected)
    pipeline.schedule.eval(*args)
    return torch.zeros(input_ids.shape[0])
