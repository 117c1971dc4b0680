"""trainer/plan/stage.py: the stage contract. A stage written against it alone (tests/helpers/custom_stage.py)
trains with its own flag, model hook, weights and resume field; the stages without a held-out metric refuse
--eval_data_path."""
import argparse

import pytest
import torch

from model.errors import ConfigError
from tests.helpers.custom_stage import EMBEDDINGS
from tests.helpers.launch import TINY_MODEL, demo_slice, forked
from trainer.ckpt.resume import read_checkpoint_model
from trainer.plan.flags import add_train_args
from trainer.plan.resolve import resolve
from trainer.rl.agent import AgentPlan
from trainer.rl.grpo import GRPOPlan
from trainer.rl.ppo import PPOPlan
from trainer.stages.dpo import DPOPlan


@pytest.mark.parametrize("stage", [DPOPlan, GRPOPlan, PPOPlan, AgentPlan])
def test_a_stage_without_a_held_out_metric_refuses_eval_data(tmp_path, stage):
    data = demo_slice(tmp_path, "sft", 8)
    args = add_train_args(argparse.ArgumentParser(), stage).parse_args(
        [*TINY_MODEL, "--device", "cpu", "--save_dir", str(tmp_path), "--eval_data_path", data])
    with pytest.raises(ConfigError) as error:
        resolve(args, 1, stage=stage)
    assert str(error.value) == (f"--eval_data_path: {stage.name} logs its rewards instead of a held-out LM loss; "
                                "leave it out")


def test_a_stage_added_through_the_contract_alone(tmp_path):
    """Two steps of tests/helpers/custom_stage.py: the checkpoints of steps 1 and 2 differ in the embeddings only (its
    prepare_model froze the rest), the weights file holds exactly step 2's embeddings (its weights_state), --tag
    parses as its FLAGS declare, and a resume with another --tag is refused in one line (its resume_fields)."""
    out = tmp_path / "out"
    args = [*TINY_MODEL, "--data_path", demo_slice(tmp_path, "sft", 40), "--max_seq_len", "64", "--batch_size", "2",
            "--accumulation_steps", "1", "--max_steps", "2", "--save_interval", "1", "--learning_rate", "1e-2",
            "--save_dir", out, "--checkpoint_dir", out / "ckpt", "--log_dir", "none", "--tag", "b"]
    proc = forked("tests/helpers/custom_stage.py", args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [read_checkpoint_model(str(out / "ckpt" / "emb_64" / f"step_{n}"))[0] for n in (1, 2)]
    changed = sorted(name for name in steps[0] if not torch.equal(steps[0][name], steps[1][name]))
    assert changed == sorted([EMBEDDINGS, "lm_head.weight"])  # the tied lm_head is the embedding
    weights = torch.load(out / "emb_64.pth", weights_only=True)
    assert list(weights) == [EMBEDDINGS] and torch.equal(weights[EMBEDDINGS], steps[1][EMBEDDINGS])
    resumed = forked("tests/helpers/custom_stage.py", [*args[:-1], "c", "--from_resume", "1", "--max_steps", "3"],
                     timeout=300)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert resumed.stderr.strip().splitlines()[-1] == (
        f"error: {out / 'ckpt' / 'emb_64' / 'step_2'} was saved with --tag b, this run has --tag c; pass --tag b to "
        "continue it, or --from_resume 0 to start over")
