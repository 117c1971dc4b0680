"""DPO's reference log-probs: computed once before training, in the training layout, by the reference model loaded
alone and dropped after (so no second model lives beside the policy), and cached beside the token cache.

A cache file is keyed by the pairs' tokens and by the reference's content (the sha256 of its weights at the run's
start, the model fields, the dtype), so a resume finds the run's own reference even where its weights file was
overwritten since. Each file carries its shape and a checksum: a damaged one is computed again with a note, or, where
the reference it came from is gone, the run stops with one line naming it.
"""
import gc
import hashlib
import json
import os

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dataset.mixture import leaf_datasets
from model.atomic import atomic_save
from model.errors import ConfigError
from model.provenance import short
from model.weights.shapes import config_fields
from trainer.base.launch import count_sum, is_main_process, setup_seed
from trainer.base.log import Logger
from trainer.ckpt.storage import rank0_write
from trainer.ckpt.weights_file import init_model
from trainer.core.batches import autocast, step_targets
from trainer.core.data_loading import LongestRows
from trainer.core.log_probs import sequence_log_probs
from trainer.parallel.parallelize import parallelize
from trainer.parallel.tensor import tp_loss_context

REFERENCE_FORMAT_VERSION = 2  # 2: keyed by the reference's content; the file holds its shape and a checksum
CACHE_SLACK_BYTES = 64 << 10  # torch.save's headers around the values


def attach_reference(plan, dims, train_ds, objective):
    """Give every DPODataset under `train_ds` its reference log-probs (set_reference): read from the cache, or
    computed once in this layout by the reference model, which is then dropped, and cached by rank 0.

    Every rank computes its data-parallel share; the shares are summed over all ranks, so every rank holds
    the same values, whether or not it can read the file rank 0 writes."""
    stage, datasets = plan.stage, leaf_datasets(train_ds)
    paths = [reference_cache_path(ds, plan) for ds in datasets]
    values = [read_reference_cache(path, len(ds)) for path, ds in zip(paths, datasets)]
    missing = [path for path, value in zip(paths, values) if value is None]
    if count_sum(int(bool(missing))):  # one rank missing one: all compute them all
        if stage.ref_changed:
            raise ConfigError(
                f"--ref_weight {stage.ref_weight} no longer holds this run's reference (its content has changed since "
                f"the run started with sha256 {short(stage.ref_sha256)}: a save of this run over it?) and the run's "
                f"reference log-probs {(missing or paths)[0]} are gone; pass --ref_weight with the starting weights, "
                "or --from_resume 0 to start over")
        Logger(f"reference log-probs: computing them with {stage.ref_weight} (once; cached beside the tokens)")
        model_parts, pipeline = load_reference(plan, dims)
        values = [reference_log_probs(model_parts, pipeline, ds, plan, dims, objective) for ds in datasets]
        del model_parts, pipeline
        release_memory(plan)
        for path, value in zip(paths, values):
            rank0_write(os.path.dirname(path), value.nbytes + CACHE_SLACK_BYTES, path, "--cache_dir",
                        lambda path=path, value=value: write_reference_cache(path, value))
    elif stage.ref_changed:
        Logger(f"--ref_weight {stage.ref_weight} has changed since this run started (sha256 "
               f"{short(stage.ref_sha256)} then): the run keeps its own reference, from its cached log-probs")
    for ds, value in zip(datasets, values):
        ds.set_reference(value)


def reference_cache_path(ds, plan):
    """<token cache dir>/<data file>.dpo_ref.<digest>.pt, keyed by the pairs' tokens and the reference model."""
    reference = [plan.stage.ref_sha256, config_fields(plan.model.config.to_dict()), str(plan.model.dtype)]
    key = json.dumps([REFERENCE_FORMAT_VERSION, ds.cache_key(), reference], sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    token_cache = ds.cache_key()[0]  # the rows' token cache (DPO: the chosen side's; KTO: its rows')
    return os.path.join(os.path.dirname(token_cache), f"{os.path.basename(ds.data_path)}.dpo_ref.{digest}.pt")


def _checksum(values):
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float64).tobytes()).hexdigest()


def write_reference_cache(path, values):
    """The (pairs, 2) log-probs at `path` with their format, shape and checksum, atomically."""
    atomic_save({"format": REFERENCE_FORMAT_VERSION, "shape": list(values.shape), "sha256": _checksum(values),
                 "log_probs": torch.from_numpy(values)}, path)


def read_reference_cache(path, num_pairs):
    """The cached (num_pairs, 2) log-probs of `path`; None when absent, or damaged (then with a note: recomputed)."""
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        values = saved["log_probs"].numpy()
        problem = (None if saved["shape"] == [num_pairs, 2] == list(values.shape) and
                   saved["sha256"] == _checksum(values) else "its values do not match its header")
    except Exception as e:  # cut short, overwritten, an older format: none of it is trusted
        problem = f"unreadable: {type(e).__name__}"
    if problem is None:
        return values
    Logger(f"note: the reference log-probs cache {path} is damaged ({problem}); computing it again")
    return None


def load_reference(plan, dims):
    """The reference model in the training layout, eval mode; the RNG is reseeded after, so that a seeded policy
    init (--from_weight none) equals a seeded reference."""
    setup_seed(plan.data.seed)
    try:
        model = init_model(plan.model.config, plan.stage.ref_weight, role="Reference model (frozen)")
        model = model.to(plan.layout.device).eval()
    except ConfigError as e:
        raise ConfigError(f"--ref_weight: {e}") from None
    model_parts, pipeline = parallelize(model, dims, plan)
    setup_seed(plan.data.seed)
    return model_parts, pipeline


def release_memory(plan):
    gc.collect()
    if plan.layout.device.startswith("cuda"):
        torch.cuda.empty_cache()


def reference_log_probs(model_parts, pipeline, ds, plan, dims, objective):
    """(len(ds), 2) float64 summed log-probs of every pair under the reference model, on every rank.

    dp rank r takes pairs [r * share, (r + 1) * share) in batches of one optimizer step's micro-batches (pipeline)
    or one micro-batch, each cut to its longest row as training cuts them; every rank runs the same number of batches
    (data-parallel wrappers gather in forward)."""
    n, rows = len(ds), plan.data.micro_batch * (plan.data.num_microbatches if pipeline is not None else 1)
    share = -(-n // plan.layout.dp)
    positions = dims.rank("dp") * share + np.arange(-(-share // rows) * rows)
    keep = (positions < min(n, (dims.rank("dp") + 1) * share)) & dims.counts_items  # who holds a pair's value
    values, cut = torch.zeros(n, 2, dtype=torch.float64), LongestRows(ds.pad_token_id, plan.row_multiple)
    for start in tqdm(range(0, len(positions), rows), desc="reference log-probs", unit="batch", delay=1,
                      disable=not is_main_process(), dynamic_ncols=True):  # its own bar, with ETA, before training
        index = positions[start:start + rows] % n
        pairs = [ds[int(i)] for i in index]
        input_ids, labels = [torch.stack([p[k] for p in pairs]) for k in (0, 1)]
        if plan.row_multiple is not None:  # as training cuts them
            input_ids, labels = cut.cut([input_ids, labels])
        with torch.no_grad():
            log_probs = forward_pair_log_probs(model_parts, pipeline, input_ids, labels, plan, objective)
        held = keep[start:start + rows]
        if held.any():
            values[index[held]] = log_probs.double().cpu()[torch.from_numpy(held)]
    if dist.is_initialized():
        values = values.to(plan.layout.device)
        dist.all_reduce(values)  # each pair is held by exactly one rank: the sum is that rank's value
    return values.cpu().numpy()


def forward_pair_log_probs(model_parts, pipeline, input_ids, labels, plan, objective):
    """(B, 2) summed target log-probs of B pairs (input_ids, labels (B, 2, L), CPU): as the objective lays pairs out
    (objective.pair_log_probs), or two rows each through the pipeline's forward-only schedule when pp > 1 (zeros off
    the last stage)."""
    device = plan.layout.device
    if pipeline is None:
        with tp_loss_context(plan.layout.tp > 1), autocast(plan):
            return objective.pair_log_probs(model_parts[0], input_ids, labels, device)
    input_ids, targets = input_ids.flatten(0, 1).to(device), step_targets(labels.flatten(0, 1)).to(device)
    values = pipeline.forward_only(input_ids, targets, sequence_log_probs)
    return torch.zeros(input_ids.shape[0] // 2, 2) if values is None else values.view(-1, 2)


def forward_log_probs(model_parts, pipeline, input_ids, targets, plan, objective):
    """(rows,) summed target log-probs; through the pipeline's forward-only schedule when pp > 1 (zeros off the
    last stage)."""
    if pipeline is None:
        with tp_loss_context(plan.layout.tp > 1), autocast(plan):
            return objective.log_probs(model_parts[0], input_ids, targets)[0]
    values = pipeline.forward_only(input_ids, targets, sequence_log_probs)
    return torch.zeros(input_ids.shape[0]) if values is None else values
