"""A stage added through the contract alone (trainer/plan/stage.py), run by tests/test_stage.py: SFT rows and loss, only
the embeddings train, the weights file holds only them, and a flag of its own that a resume checks."""
from dataclasses import dataclass

from trainer.base.launch import main_guard
from trainer.base.schema import Flag
from trainer.core.build import build_trainer, setup, steps_per_epoch
from trainer.core.data_loading import load_datasets
from trainer.core.loop import train
from trainer.plan.flags import parse_args
from trainer.stages.sft import SFTStage

EMBEDDINGS = "model.embed_tokens.weight"


@dataclass(frozen=True)
class EmbeddingsStage(SFTStage):
    """Trains the token embeddings alone."""
    tag: str
    name = "embeddings-only"
    FLAGS = (Flag("tag", str, "a", "a label the run's checkpoints record: a resume with another one is refused"),)

    @classmethod
    def resolve(cls, args, plan):
        return cls(tag=args.tag)

    def prepare_model(self, model):
        for name, param in model.named_parameters():
            param.requires_grad_(name == EMBEDDINGS)
        return model

    def resume_fields(self):
        return {"--tag": self.tag}

    def weights_state(self, model_state):
        return {EMBEDDINGS: model_state[EMBEDDINGS]}


def main():
    args = parse_args("embeddings only", EmbeddingsStage, save_weight="emb")
    # 1. set-up, 2. data, 3. the objective (SFT's), 4-7. model, wrap, optimizer, 8. the loop
    plan, dims = setup(args, EmbeddingsStage)
    train_ds, eval_ds = load_datasets(plan)
    objective = plan.stage.objective(plan, dims, train_ds)
    trainer = build_trainer(plan, dims, steps_per_epoch(plan, train_ds), objective)
    train(trainer, train_ds, eval_ds)


if __name__ == "__main__":
    main_guard(main)
