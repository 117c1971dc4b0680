"""Supervised fine-tuning's stage: pretraining's contract (trainer/plan/stage.py) on chat rows (dataset/chat.py
SFTDataset), the loss on the assistant's tokens. The base of LoRA's, distillation's and GKD's stages."""
from dataclasses import dataclass

from dataset.chat import SFTDataset
from dataset.shards import local_part
from trainer.plan.stage import Stage


@dataclass(frozen=True)
class SFTStage(Stage):
    """Supervised fine-tuning: chat rows, the loss on the assistant's tokens (the labels of SFTDataset)."""
    name = "SFT"
    demo_kind = "sft"

    def dataset(self, plan, tokenizer, path):
        """Chat rows (SFTDataset); --packing 1: whole conversations packed into rows."""
        data = plan.data
        return SFTDataset(path, tokenizer, max_length=data.seq_len, skip_bad_lines=data.skip_bad_lines,
                          cache_dir=data.cache_dir, num_proc=data.num_proc, part=local_part(), packing=data.packing,
                          doc_mask=data.doc_mask)
