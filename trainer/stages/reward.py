"""The reward model (TRL's RewardTrainer): a scalar head on the trunk, trained with the Bradley-Terry loss on DPO's
chosen/rejected pairs.

r(x, y) = w . h_last, h_last the final norm's output at the row's last non-pad token (as transformers'
*ForSequenceClassification reads it); loss = -logsigmoid(r(chosen) - r(rejected) - margin), averaged over the step's
pairs (margin: the file's optional "margin" column, else 0). The head is hung on the final norm from outside the
model, as PPO's value head is (trainer/rl/ppo.py): it goes wherever the norm goes (replicated under tensor parallel,
with the root's parameters under FSDP2) and lives in resume checkpoints with the trunk. The weights file holds the
trunk and the head as `score.weight`; beside it, <name>_hf/ is transformers' Qwen3ForSequenceClassification with the
tokenizer, which GRPO/PPO read as --reward_model (trainer/rl/rewards.py).
"""
import os
import shutil
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dataset.mixture import leaf_datasets
from dataset.preference_data import RewardPairs
from dataset.shards import local_part
from model.atomic import atomic_folder
from model.errors import ConfigError
from model.hf_convert import save_hf_classifier
from model.provenance import tokenizer_files
from model.weights.files import save_weights_file
from model.weights.shapes import clean_state_dict
from trainer.base.log import Logger
from trainer.core.trunk_head import TrunkHead
from trainer.plan.objective import LMObjective
from trainer.plan.stage import SIDECAR_BYTES, Stage
from trainer.stages.dpo import check_pairs_layout

HEAD_KEY = "model.norm.score_head.weight"  # the head in the model's state dict (checkpoints)
SCORE_KEY = "score.weight"  # transformers' name of a sequence classifier's head, used in the weights file


class ScoreHead(TrunkHead):
    """One linear unit without bias on the final norm's output (transformers' `score`), attached from outside; drawn
    from its own generator (the global RNG stays the trunk's), N(0, initializer_range) as transformers draws it."""
    ATTRIBUTE = "score_head"

    def __init__(self, hidden_size, seed, std=0.02):
        super().__init__(hidden_size, bias=False)
        with torch.no_grad():
            self.weight.normal_(0, std, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class RewardPlan(Stage):
    """The reward-model stage (trainer/plan/stage.py): pairs in, a scalar head on the trunk, Bradley-Terry."""
    seed: int  # the head's initialisation
    name = "reward model"
    demo_kind = "dpo"
    rows_per_sample = 2
    has_eval = False  # it logs its pair accuracy and margin

    @classmethod
    def resolve(cls, args, plan):
        check_pairs_layout(plan, "the reward model")
        if plan.layout.pp > 1:
            raise ConfigError("the reward model does not run with --pp > 1 (its score head reads the last stage's "
                              "hidden states in the loss); use --tp or --zero_stage 3 for a large model")
        return cls(seed=plan.data.seed)

    def dataset(self, plan, tokenizer, path):
        """Chosen/rejected chat pairs (DPO's format) with their optional margin."""
        return RewardPairs(path, tokenizer, max_length=plan.data.seq_len, skip_bad_lines=plan.data.skip_bad_lines,
                           cache_dir=plan.data.cache_dir, num_proc=plan.data.num_proc, part=local_part())

    def objective(self, plan, dims, train_ds):
        Logger(f"reward model from --from_weight {plan.model.from_weight}: a score head on the trunk, Bradley-Terry "
               "on chosen/rejected pairs")
        return RewardObjective(leaf_datasets(train_ds)[0].pairs.chosen.pad_token_id)

    def prepare_model(self, model):
        """A fresh score head on the plain model's trunk (a resume loads its weights); the LM head, unused, frozen
        where it is its own weight (tied, it is the embedding, which the trunk trains)."""
        ScoreHead(model.config.hidden_size, self.seed, model.config.initializer_range
                  if hasattr(model.config, "initializer_range") else 0.02).attach(model)
        if not model.config.tie_word_embeddings:
            model.lm_head.requires_grad_(False)
        return model

    def weights_state(self, model_state):
        """The trunk and the head as `score.weight`."""
        trunk = {k: v for k, v in clean_state_dict(model_state).items() if k != HEAD_KEY}
        return dict(trunk, **{SCORE_KEY: model_state[HEAD_KEY]})

    def save_weights(self, model_state, config, save_dtype, record, path):
        """The .pth (trunk + score.weight) + sidecar, and beside it <name>_hf/: the transformers sequence classifier
        with the run's tokenizer (what --reward_model reads)."""
        state = {k: v.to(save_dtype) for k, v in self.weights_state(model_state).items()}
        save_weights_file(state, config, path, dict(record, reward_head=SCORE_KEY))
        score = state.pop(SCORE_KEY)
        with atomic_folder(hf_folder(path)) as folder:
            save_hf_classifier(state, score, config, folder, save_dtype)
            tokenizer = record["tokenizer"]["path"]
            for name in tokenizer_files(tokenizer):
                shutil.copy(os.path.join(tokenizer, name), folder)

    def weights_bytes(self, model_state, save_dtype, record):
        return 2 * super().weights_bytes(model_state, save_dtype, record) + SIDECAR_BYTES + (32 << 20)  # + tokenizer


def hf_folder(weights_path):
    """out/reward_512.pth -> out/reward_512_hf (the sequence classifier for --reward_model)."""
    return os.path.splitext(weights_path)[0] + "_hf"


def bradley_terry(scores, last, margins):
    """(loss sum, stats) of a micro-batch: scores (2B, L) at each row's last token `last` (2B,), pairs interleaved
    (chosen first), margins (B,)."""
    rewards = scores.gather(1, last.view(-1, 1).to(scores.device)).view(-1, 2)
    differences = rewards[:, 0] - rewards[:, 1]
    losses = -F.logsigmoid(differences - margins.to(rewards))
    detached, gaps = rewards.detach(), differences.detach()
    return losses.sum(), {"chosen_sum": detached[:, 0].sum(), "rejected_sum": detached[:, 1].sum(),
                          "accuracy_sum": (gaps > 0).float().sum(), "margin_sum": gaps.sum()}


class RewardObjective(LMObjective):
    """Bradley-Terry on the score head for train_step (see trainer/plan/objective.py for the methods)."""

    stat_names = ("chosen_sum", "rejected_sum", "accuracy_sum", "margin_sum")
    items_are_tokens = False  # count() gives pairs

    def __init__(self, pad_token_id):
        self.pad_token_id, self.head = pad_token_id, None

    def prepare(self, trainer, micro_batches):
        self.head = self.head or next(m for part in trainer.model_parts for m in part.modules()
                                      if isinstance(m, ScoreHead))
        return micro_batches

    def unpack(self, batch):
        """(B, 2, L) pairs -> (2B, L) rows; extra: each row's last non-pad position (transformers' rule) and the
        pairs' margins."""
        input_ids, labels, margins = batch
        rows = input_ids.flatten(0, 1)
        positions = torch.arange(rows.shape[1])
        last = ((rows != self.pad_token_id) * positions).argmax(dim=1)
        return rows, labels.flatten(0, 1), None, (last, margins)

    def count(self, labels, extra):
        return labels.shape[0] // 2  # pairs

    def scores(self, model, input_ids, position_ids=None):
        out = model(input_ids, position_ids=position_ids, logits_to_keep=1)  # the LM head on one position only
        return self.head.take(), out.aux_loss

    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        scores, aux_loss = self.scores(model, input_ids, position_ids)
        loss_sum, stats = bradley_terry(scores, *extra)
        return loss_sum / num_items, aux_loss, stats

    def record(self, stats, num_items):
        """TRL's reward trainer: how often chosen scores higher, the mean score gap, each side's mean score."""
        pairs = max(num_items, 1)
        return {"accuracy": stats["accuracy_sum"] / pairs, "margin": stats["margin_sum"] / pairs,
                "rewards/chosen": stats["chosen_sum"] / pairs, "rewards/rejected": stats["rejected_sum"] / pairs}

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The trunk on every position; the LM head on none (one position per row: negligible)."""
        return super().flops(config, seq_len, positions, 0, True)
