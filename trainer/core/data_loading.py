"""Phase 2 of every stage, the data: the datasets of --data_path (or the embedded demo corpus), checked, and the
DataLoader of one data-parallel rank's micro-batches of an epoch."""
from torch.utils.data import DataLoader, DistributedSampler, Sampler, default_collate
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
        data, dp = plan.data, plan.layout.dp
        factors = f"--batch_size {data.micro_batch} x --accumulation_steps {data.num_microbatches} x dp {dp}"
        raise ConfigError(f"{data_path} has {len(train_ds)} samples, fewer than one global batch ({data.global_batch} "
                          f"= {factors}); {small_batch(len(train_ds), data.micro_batch, dp)}")
    return train_ds, eval_ds


def small_batch(samples, micro_batch, dp):
    """The flags that fit a global batch to a small dataset: --accumulation_steps 1 and the largest power-of-two
    --batch_size (at most the typed one) that leaves an epoch of at least 4 steps (1 where the data is that small)."""
    if samples < dp:
        return f"run on at most {samples} data-parallel processes"
    fits = max(1, samples // (4 * dp))
    batch = min(micro_batch, 1 << (fits.bit_length() - 1))
    steps = samples // (batch * dp)
    return (f"pass --batch_size {batch} --accumulation_steps 1 ({steps} step{'s' if steps != 1 else ''} an epoch; "
            "--epochs for more)")


def dataset_notes(ds):
    """The info lines a dataset gives about what it loses or lacks (its `notes()`: chat, preference and prompt data,
    dataset/chat.py, preference_data.py, rlaif_dataset.py); none for pretraining's rows."""
    return ds.notes() if hasattr(ds, "notes") else []


def rows_line(ds, seq_len):
    """What the training rows are: '8177 rows of 64 tokens packed from 5026 documents' (the file's lines; SFT: the
    conversations with a target, the others are left out), '5026 rows, one per document' or '600 samples' (pairs,
    prompts): the count the steps per epoch come from."""
    leaves = leaf_datasets(ds)
    documents = [len(leaf.offsets) - 1 for leaf in leaves if getattr(leaf, "offsets", None) is not None]
    if len(documents) < len(leaves) or not leaves:  # a dataset without a token cache (pairs, prompts)
        return f"{len(ds)} samples"
    unit = "documents" if all(getattr(leaf, "kind", None) == "pretrain" for leaf in leaves) else "conversations"
    if any(getattr(leaf, "packing", False) for leaf in leaves):  # SFT packs the conversations with a target only
        packed = sum(len(leaf.row_docs) if getattr(leaf, "row_docs", None) is not None else n
                     for leaf, n in zip(leaves, documents))
        return f"{len(ds)} rows of {seq_len} tokens packed from {packed} {unit}"
    return f"{len(ds)} rows, one per {unit[:-1]}" if len(ds) == sum(documents) else \
        f"{len(ds)} rows from {sum(documents)} {unit}"


def row_collate(plan, ds):
    """The collate of `ds`'s micro-batches: LongestRows where the plan cuts rows (TrainPlan.row_multiple; a padded-rows
    stage's datasets give their pad_token_id), else torch's default (None)."""
    return None if plan.row_multiple is None else LongestRows(leaf_datasets(ds)[0].pad_token_id, plan.row_multiple)


class LongestRows:
    """A collate: samples stacked (default_collate), then the batch's rows, its first two tensors (token ids, labels;
    (B, [2,] L), right-padded), cut to the longest row rounded up to `multiple` (at most L).

    A row runs to its last token that is not padding or is a target. Under causal attention a position's output depends
    only on the positions before it: nothing a loss reads changes (the targets, the reward model's last non-pad token),
    so cut rows compute what rows padded to --max_seq_len computed, up to the order of fp32 sums."""

    def __init__(self, pad_token_id, multiple):
        self.pad_token_id, self.multiple = pad_token_id, multiple

    def __call__(self, samples):
        return self.cut(default_collate(samples))

    def cut(self, batch):
        """`batch` (a list or a tuple, returned as it came) with its rows cut; the other tensors as they are."""
        input_ids, labels = batch[0], batch[1]
        width = input_ids.shape[-1]
        length = min(width, -(-longest_row(input_ids, labels, self.pad_token_id) // self.multiple) * self.multiple)
        if length == width:
            return batch
        return type(batch)([input_ids[..., :length].contiguous(), labels[..., :length].contiguous(), *batch[2:]])


def longest_row(input_ids, labels, pad_token_id):
    """1 + the last position any row uses (a token that is not padding, or a target); at least 1."""
    used = ((input_ids != pad_token_id) | (labels != -100)).reshape(-1, input_ids.shape[-1]).any(0)
    hits = used.nonzero()
    return int(hits[-1]) + 1 if len(hits) else 1


def leaf_datasets(ds):
    """The per-file datasets under a ConcatDataset (.datasets) or a MixtureDataset (.sources); [] for None."""
    if ds is None:
        return []
    children = getattr(ds, "datasets", None) or getattr(ds, "sources", None)
    return [leaf for child in children for leaf in leaf_datasets(child)] if children else [ds]


def epoch_loader(train_ds, epoch, seed, micro_batch, dp=1, dp_rank=0, num_workers=0, pin_memory=False, skip_batches=0,
                 collate_fn=None):
    """The DataLoader of one dp rank's micro-batches of `epoch` (scripts/bench_loader.py times it alone); collate_fn:
    row_collate's, else torch's default."""
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)  # data order is a pure function of (seed, epoch)
    if hasattr(train_ds, "set_epoch"):  # a weighted mixture draws its rows per epoch, from (seed, epoch) too
        train_ds.set_epoch(epoch)
    return DataLoader(train_ds, batch_sampler=SkipBatchSampler(sampler, micro_batch, skip_batches),
                      num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn)


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
