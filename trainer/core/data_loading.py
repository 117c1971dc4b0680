"""Phase 2 of every stage, the data: the datasets of --data_path (or the embedded demo corpus), and the DataLoader of
one data-parallel rank's micro-batches of an epoch (rows cut to the longest where the plan says). What a run says about
its data is trainer/observe/console.py's, the advice when it cannot fill a step trainer/plan/checks.py's."""
from torch.utils.data import DataLoader, DistributedSampler, Sampler, default_collate
from transformers import AutoTokenizer

from dataset.demo_data import ensure_demo_data
from dataset.mixture import leaf_datasets, load_data_spec
from model.errors import ConfigError
from trainer.base.log import Logger
from trainer.observe.console import data_lines
from trainer.plan.checks import check_fills_a_step


def load_datasets(plan):
    """Phase 2: the stage's train/eval datasets (Stage.dataset of each file; its demo data when no --data_path), with
    the run's tokenizer; data errors become ConfigErrors, what the data holds is said (trainer/observe/console.py
    data_lines), and data smaller than one step refused (trainer/plan/checks.py check_fills_a_step).

    A --data_path of several sources is concatenated, or mixed by its weights (dataset/mixture.py)."""
    stage, tokenizer = plan.stage, AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
    data_path = plan.data.data_path or ensure_demo_data(stage.demo_kind, announce=Logger)  # built on first use

    def make_dataset(path):
        return stage.dataset(plan, tokenizer, path)
    try:
        train_ds = load_data_spec(data_path, make_dataset, seed=plan.data.seed)
        eval_path = plan.data.eval_data_path
        eval_ds = load_data_spec(eval_path, make_dataset, seed=plan.data.seed) if eval_path else None
        lines = data_lines(plan, data_path, train_ds, eval_ds)  # what they hold, skip, lose or lack
    except (ValueError, FileNotFoundError, TimeoutError) as e:
        raise ConfigError(str(e))
    for line in lines:
        Logger(line)
    check_fills_a_step(len(train_ds), data_path, plan)  # at least one global batch, or the flags that fit one
    return train_ds, eval_ds


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
