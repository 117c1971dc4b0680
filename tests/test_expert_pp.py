"""Expert parallel composed with pipeline parallel (`--ep 2 --pp 2`) on the real trainer: each pipeline stage's MoE
experts are sharded over the ep ranks of that stage (ep carved out of dp at a fixed pp coordinate), the two dp
replicas run the same schedule so their all-to-alls pair up, and the run equals the single process
(tests/test_layouts.assert_same_run: every step's loss, aux loss and tokens, the gathered weights against the run's own
checkpoint, the last step against one process resumed from the layout's step-4 checkpoint)."""
import json
import os

import pytest
import torch.distributed as dist

from tests.helpers.launch import forked, read_metrics, spawn
from tests.helpers.layouts import (
    SCRIPT,
    STEPS,
    assert_same_records,
    assert_same_run,
    final_weights,
    run_args,
    run_layout,
)
from trainer.parallel.mesh import ParallelDims

EP_PP = ["--ep", "2", "--pp", "2"]


def expert_names(layers, experts=4):
    """Every routed expert weight of the MoE model (hand-written: test_layouts' model has 4 experts per layer)."""
    return {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for layer in range(layers) for e in range(experts)
            for proj in ("gate_proj", "up_proj", "down_proj")}


def _groups_worker(rank, world_size, out_dir):
    dims = ParallelDims.build(world_size, device_type="cpu", pp=2, ep=2)
    groups = {name: dist.get_process_group_ranks(dims.group(name)) for name in ("pp", "ep", "ep_replica")}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(groups, pp_rank=dims.rank("pp")), f)


def test_ep_groups_join_ranks_of_one_stage(tmp_path):
    """8 ranks, dp 4 x pp 2 (rank = 2 * dp + pp), ep 2 carved out of dp: an ep group is two consecutive dp ranks at the
    same stage, its replica group the same ep position in the other dp slice; each with this rank's pp coordinate."""
    spawn(_groups_worker, 8, str(tmp_path), timeout=90, start_method="fork")
    for rank in range(8):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        dp, pp = divmod(rank, 2)
        slice_start = dp - dp % 2
        assert got["pp_rank"] == pp and got["pp"] == [2 * dp, 2 * dp + 1]
        assert got["ep"] == [2 * slice_start + pp, 2 * (slice_start + 1) + pp]
        assert got["ep_replica"] == [2 * (dp % 2) + pp, 2 * (dp % 2 + 2) + pp]


# 4 ranks (ep = dp = 2), 1F1B: the default; 8 ranks (dp 4, each expert on two ranks of its stage, their gradients
# summed by reduce_expert_grads over the stage's part), GPipe: every forward before any backward; 8 ranks with cp 2
# (dp 2 x pp 2 x cp 2: each stage's experts replicated on its cp peers, which route the other half of each sequence);
# 8 ranks with tp 2 (the experts whole on both tp ranks of a stage, ETP=1, each tp rank its own ep group)
@pytest.mark.parametrize("nproc,flags", [(4, ["--pp_schedule", "1f1b"]), (8, ["--pp_schedule", "gpipe"]),
                                         (8, ["--cp", "2"]), (8, ["--tp", "2"])],
                         ids=["1f1b", "gpipe-dp4", "cp2", "tp2"])
def test_ep2_pp2_training_run_equals_one_process(nproc, flags, data, reference, tmp_path):  # noqa: F811
    workdir = run_layout(tmp_path, data, "moe", nproc, [*EP_PP, *flags], ["--max_steps", str(STEPS)])
    assert expert_names(2) <= final_weights(workdir, "moe").keys()  # both stages' experts, from both ep ranks
    assert_same_run(workdir, data, "moe", reference["moe"])


def test_ep2_pp2_interleaved_equals_one_process(data, tmp_path):  # noqa: F811
    """Interleaved 1F1B (4 layers: two stages per rank, each with its own experts' all-to-alls): every step's loss, aux
    loss and tokens equal a single process's on the same 4-layer model; the weights file holds every expert."""
    four_layers = ["--num_hidden_layers", "4", "--max_steps", str(STEPS)]
    single = str(tmp_path / "single")
    proc = forked(SCRIPT, run_args(single, data, "moe", 1, four_layers))
    assert proc.returncode == 0, proc.stderr[-3000:]
    workdir = run_layout(tmp_path / "layout", data, "moe", 4, [*EP_PP, "--pp_schedule", "interleaved1f1b"],
                         four_layers)
    weights = final_weights(workdir, "moe")
    assert expert_names(4) <= weights.keys()
    assert_same_records(read_metrics(os.path.join(workdir, "m.jsonl")), read_metrics(os.path.join(single, "m.jsonl")),
                        sum(w.numel() for w in weights.values()))


def test_ep_with_pp_needs_dp_ranks_to_carve(data, tmp_path):  # noqa: F811
    """2 processes with --pp 2 leave one dp rank: --ep 2 is refused in one line naming that dp size, on every rank."""
    proc = forked(SCRIPT, run_args(str(tmp_path), data, "moe", 1, EP_PP), 2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "must divide the data-parallel size (1)" in errors[0]
