"""Phase 2 of every stage, the data: the datasets of --data_path (or the embedded demo corpus), checked, and the
DataLoader of one data-parallel rank's micro-batches of an epoch."""
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from transformers import AutoTokenizer

from dataset.demo_data import ensure_demo_data
from dataset.mixture import describe_mixture, load_data_spec
from model.errors import ConfigError
from trainer.base.log import Logger


def load_datasets(plan):
    """Phase 2: the stage's train/eval datasets (Stage.dataset of each file; its demo data when no --data_path), with
    the run's tokenizer; data errors become ConfigErrors.

    A --data_path of several sources is concatenated, or mixed by its weights (dataset/mixture.py)."""
    stage, tokenizer = plan.stage, AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
    data_path = plan.data.data_path or ensure_demo_data(stage.demo_kind, announce=Logger)  # built on first use

    def make_dataset(path):
        return stage.dataset(plan, tokenizer, path)
    try:
        train_ds = load_data_spec(data_path, make_dataset, seed=plan.data.seed)
        eval_path = plan.data.eval_data_path
        eval_ds = load_data_spec(eval_path, make_dataset, seed=plan.data.seed) if eval_path else None
    except (ValueError, FileNotFoundError, TimeoutError) as e:
        raise ConfigError(str(e))
    for path, ds in ((data_path, train_ds), (plan.data.eval_data_path, eval_ds)):
        skipped = sum(getattr(d, "num_bad_lines", 0) for d in leaf_datasets(ds))
        if skipped:  # only with --skip_bad_lines 1; otherwise a bad row stops the run
            Logger(f"--skip_bad_lines: skipped {skipped} bad rows of {path}")
    try:  # rows without targets, conversations cut at --max_seq_len, DPO pairs with chosen == rejected
        notes = [line for ds in leaf_datasets(train_ds) + leaf_datasets(eval_ds) for line in dataset_notes(ds)]
    except ValueError as e:
        raise ConfigError(str(e))
    for line in notes:
        Logger(line)
    Logger(f"Data: {data_path} ({rows_line(train_ds, plan.data.seq_len)}), tokenizer {plan.data.tokenizer_path}")
    if describe_mixture(train_ds, data_path):
        Logger(describe_mixture(train_ds, data_path))
    if len(train_ds) < plan.data.global_batch:
        raise ConfigError(f"{data_path} has {len(train_ds)} samples, fewer than one global batch "
                          f"({plan.data.global_batch} = batch_size x accumulation_steps x dp); lower --batch_size")
    return train_ds, eval_ds


def dataset_notes(ds):
    """The info lines a dataset gives about what it loses or lacks (its `notes()`: chat, preference and prompt data,
    dataset/chat.py, preference_data.py, rlaif_dataset.py); none for pretraining's rows."""
    return ds.notes() if hasattr(ds, "notes") else []


def rows_line(ds, seq_len):
    """What the training rows are: '8177 rows of 64 tokens packed from 5026 documents' (the file's lines), '5026
    rows, one per document' or '600 samples' (pairs, prompts): the count the steps per epoch come from."""
    leaves = leaf_datasets(ds)
    documents = [len(leaf.offsets) - 1 for leaf in leaves if getattr(leaf, "offsets", None) is not None]
    if len(documents) < len(leaves) or not leaves:  # a dataset without a token cache (pairs, prompts)
        return f"{len(ds)} samples"
    unit = "documents" if all(getattr(leaf, "kind", None) == "pretrain" for leaf in leaves) else "conversations"
    if any(getattr(leaf, "packing", False) for leaf in leaves):
        return f"{len(ds)} rows of {seq_len} tokens packed from {sum(documents)} {unit}"
    return f"{len(ds)} rows, one per {unit[:-1]}" if len(ds) == sum(documents) else \
        f"{len(ds)} rows from {sum(documents)} {unit}"


def leaf_datasets(ds):
    """The per-file datasets under a ConcatDataset (.datasets) or a MixtureDataset (.sources); [] for None."""
    if ds is None:
        return []
    children = getattr(ds, "datasets", None) or getattr(ds, "sources", None)
    return [leaf for child in children for leaf in leaf_datasets(child)] if children else [ds]


def epoch_loader(train_ds, epoch, seed, micro_batch, dp=1, dp_rank=0, num_workers=0, pin_memory=False, skip_batches=0):
    """The DataLoader of one dp rank's micro-batches of `epoch` (scripts/bench_loader.py times it alone)."""
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)  # data order is a pure function of (seed, epoch)
    if hasattr(train_ds, "set_epoch"):  # a weighted mixture draws its rows per epoch, from (seed, epoch) too
        train_ds.set_epoch(epoch)
    return DataLoader(train_ds, batch_sampler=SkipBatchSampler(sampler, micro_batch, skip_batches),
                      num_workers=num_workers, pin_memory=pin_memory)


class SkipBatchSampler(Sampler):
    """Groups sampler indices into full batches, skipping the first `skip_batches` (for mid-epoch resume)."""

    def __init__(self, sampler, batch_size, skip_batches=0):
        self.sampler, self.batch_size, self.skip_batches = sampler, batch_size, skip_batches

    def __iter__(self):
        batch, seen = [], 0
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                if seen >= self.skip_batches:
                    yield batch
                seen += 1
                batch = []
        # a partial last batch is dropped: every layout then sees the same global batches

    def __len__(self):
        return max(0, len(self.sampler) // self.batch_size - self.skip_batches)
