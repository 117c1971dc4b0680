"""The stage contract: what a training stage gives the one loop, typed, with pretraining's behaviour as the defaults.

A stage is a frozen dataclass subclassing `Stage` (its checked flags; `plan.stage` in every run), its objective
(trainer/plan/objective.py: `LMObjective` is the base and the default) and an entry script trainer/train_<stage>.py that
runs the numbered phases: parse_args(description, StageClass) -> setup(args, StageClass) -> load_datasets(plan) ->
plan.stage.objective(plan, dims, train_ds) -> build_trainer(...) -> train(...). The loop, checkpoints, callbacks and
config call the hooks below and nothing else of a stage; a hook a stage does not override keeps the default. SFT's
stage is trainer/stages/sft.py.
"""
import os
from dataclasses import dataclass

from dataset.lm_dataset import PretrainDataset
from dataset.shards import local_part
from model.weights.files import save_weights_file
from trainer.plan.objective import LMObjective

SIDECAR_BYTES = 64 << 10  # room for a weights file's sidecar and torch.save's own headers


@dataclass(frozen=True)
class Stage:
    """Pretraining, and the contract every stage fulfils (override what differs)."""
    name = "pretraining"  # the stage in one-line messages
    demo_kind = "pretrain"  # the embedded demo data without --data_path (dataset/demo_data.py)
    rows_per_sample = 1  # model rows one sample makes (DPO: a chosen/rejected pair; GRPO: its completions)
    # a sample starts with right-padded token ids and labels (its dataset gives pad_token_id): the loader cuts each
    # micro-batch to its longest row (trainer/core/data_loading.py LongestRows); RL's samples are prompts
    padded_rows = True
    has_eval = True  # a held-out metric: the objective's eval loss (else --eval_data_path is refused in one line)
    FLAGS = ()  # the stage's own flags (trainer/base/schema.py Flag), added to its script's parser

    @classmethod
    def resolve(cls, args, plan):
        """The stage's checked plan from its flags and the TrainPlan (plan.stage is the base Stage then); ConfigError
        (one line) on bad input."""
        return cls()

    def sequence_length(self, max_seq_len):
        """Tokens per training row (the model's positions, the pipeline's stage shapes): --max_seq_len."""
        return max_seq_len

    def dataset(self, plan, tokenizer, path):
        """The samples of one data file (dataset/): pretraining's rows of text."""
        data = plan.data
        return PretrainDataset(path, tokenizer, max_length=data.seq_len, packing=data.packing, doc_mask=data.doc_mask,
                               skip_bad_lines=data.skip_bad_lines, cache_dir=data.cache_dir, num_proc=data.num_proc,
                               part=local_part())

    def objective(self, plan, dims, train_ds):
        """What train_step minimises and evaluate() measures (trainer/plan/objective.py), with what it needs (a teacher,
        reference log-probs, a rollout engine), built after the data: the mean CE over target tokens."""
        return LMObjective()

    def prepare_model(self, model):
        """The plain loaded model before parallelizing (LoRA: adapters on it, the base frozen; PPO: a value head)."""
        return model

    def resume_fields(self):
        """The stage's flags that shape the saved state, {flag: value}, checked on resume
        (trainer/ckpt/resume.py)."""
        return {}

    def weights_path(self, plan):
        """The weights file the run writes: <save_dir>/<run_name>.pth (LoRA: its adapters)."""
        return plan.io.weights_path

    def best_weights_path(self, plan):
        """Where --save_best writes the best eval's weights, or None to keep its checkpoint only."""
        return os.path.splitext(plan.io.weights_path)[0] + "_best.pth"

    def weights_state(self, model_state):
        """The part of a gathered model state dict the weights file holds: all of it (PPO: not the value head)."""
        return model_state

    def save_weights(self, model_state, config, save_dtype, record, path):
        """Rank 0: MiniMind's plain weights file at `path` in save_dtype, its sidecar (config, `record`) beside it."""
        save_weights_file({k: v.to(save_dtype) for k, v in self.weights_state(model_state).items()}, config, path,
                          record)

    def weights_bytes(self, model_state, save_dtype, record):
        """About what save_weights writes, for the free-space check before it."""
        return sum(v.numel() for v in self.weights_state(model_state).values()) * save_dtype.itemsize + SIDECAR_BYTES
