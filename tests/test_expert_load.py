"""trainer/runtime/expert_load.py: per-expert loads read from a real MoE model, their record fields against a hand
computation, DeepSeek-V3's bias rule, the empty-expert warning, and the bias equal on every data-parallel rank."""
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, forked, read_metrics, spawn
from trainer.runtime.expert_load import (
    ExpertLoad,
    choose_expert_compute,
    enable_expert_bias,
    load_fields,
    moe_layers,
    take_loads,
    update_expert_bias,
)

TINY_MOE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)


def tiny_moe(seed=0):
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig(**TINY_MOE))


def routed_counts_f64(model, input_ids):
    """(layers, experts) tokens per expert, from each layer's router input captured by a hook, in float64."""
    inputs = []
    hooks = [moe.gate.register_forward_hook(lambda m, args, out: inputs.append((m, args[0].detach())))
             for _, moe in moe_layers([model])]
    was_training = model.training
    model.eval()  # a training forward would count these tokens too
    with torch.no_grad():
        model(input_ids)
    model.train(was_training)
    for hook in hooks:
        hook.remove()
    counts = []
    for gate, x in inputs:
        probs = F.softmax(x.double() @ gate.weight.double().T, dim=-1)
        counts.append(torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=4))
    return torch.stack(counts).double()


def test_expert_compute_loop_is_kept_over_the_probed_choice():
    """--expert_compute loop: every layer runs the loop and the line says so (test_moe checks the loop's numerics)."""
    model = tiny_moe()
    assert "(loop)" in choose_expert_compute([model], "cpu", torch.float32, "loop")
    assert {moe.expert_compute for _, moe in moe_layers([model])} == {"loop"}


def test_loads_of_a_step_are_the_routed_tokens_of_its_micro_batches():
    model = tiny_moe()
    batches = [torch.randint(0, 64, (2, 9)) for _ in range(2)]
    expected = sum(routed_counts_f64(model, ids) for ids in batches)
    model.train()
    for ids in batches:
        model(ids)
    loads = take_loads(moe_layers([model]))
    assert torch.equal(loads.double(), expected)
    assert torch.equal(take_loads(moe_layers([model])), torch.zeros(2, 4))  # reset after reading


def test_load_fields_min_max_and_cv_by_hand():
    fields = load_fields(["model.layers.0.mlp", "model.layers.1.mlp"], torch.tensor([[4.0, 0, 2, 2], [3, 3, 3, 3]]))
    assert fields["expert_tokens_min/layer0"] == 0 and fields["expert_tokens_max/layer0"] == 4
    assert math.isclose(fields["expert_load_cv/layer0"], math.sqrt((4 + 4 + 0 + 0) / 4) / 2, rel_tol=1e-12)
    assert fields["expert_load_cv/layer1"] == 0.0


def test_bias_rule_moves_each_expert_toward_the_mean():
    model = tiny_moe()
    enable_expert_bias([model])
    balance = ExpertLoad([model], None, balance="bias", bias_rate=0.125)
    update_expert_bias(balance.layers, torch.tensor([[4.0, 0, 2, 2], [1, 2, 3, 6]]), 0.125)
    assert torch.equal(balance.layers[0][1].expert_bias, torch.tensor([-0.125, 0.125, 0, 0]))
    assert torch.equal(balance.layers[1][1].expert_bias, torch.tensor([0.125, 0.125, 0, -0.125]))  # mean 3
    assert "model.layers.0.mlp.expert_bias" in model.state_dict()  # saved and resumed with the model


def test_an_expert_without_tokens_is_reported_once_after_n_logged_steps(capsys):
    model = tiny_moe()
    for _, moe in moe_layers([model]):
        moe.expert_bias = torch.tensor([0.0, 0.0, 0.0, -10.0])  # expert 3 never chosen (a fixed bias: no update)
    balance = ExpertLoad([model], None, balance="aux", dead_after=3)
    model.train()
    for step in range(1, 5):
        model(torch.randint(0, 64, (1, 8)))
        balance.step_end(step, {})
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning: MoE" in line]
    assert len(lines) == 2 and all("expert 3" in line and "(step 3)" in line for line in lines), lines


def _bias_over_ranks(rank, world_size, batches, out_path):
    model = tiny_moe()
    enable_expert_bias([model])
    balance = ExpertLoad([model], dist.group.WORLD, balance="both", bias_rate=0.01)
    model.train()
    model(batches[rank])
    balance.step_end(1, None)
    torch.save(torch.stack([moe.expert_bias for _, moe in balance.layers]), f"{out_path}.{rank}")


def test_bias_is_the_same_on_every_rank_and_equals_one_process(tmp_path):
    torch.manual_seed(1)
    batches = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    spawn(_bias_over_ranks, 2, batches, str(tmp_path / "bias"), start_method="fork")
    ranks = [torch.load(tmp_path / f"bias.{r}") for r in range(2)]
    model = tiny_moe()
    loads = routed_counts_f64(model, batches[0]) + routed_counts_f64(model, batches[1])  # one process, both halves
    expected = 0.01 * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    assert torch.equal(ranks[0], ranks[1])
    assert torch.equal(ranks[0], expected.float())  # +-rate from zero: exact in fp32


def _pretrain(tmp_path, run, *extra):
    out = os.path.join(str(tmp_path), run)
    args = [*TINY_MODEL, "--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2", "--max_seq_len", "32",
            "--batch_size", "4", "--accumulation_steps", "2", "--learning_rate", "3e-3", "--log_interval", "1",
            "--save_dir", out, "--checkpoint_dir", out, "--metrics_file", os.path.join(out, "m.jsonl"), *extra]
    return forked("trainer/train_pretrain.py", args, timeout=300), os.path.join(out, "m.jsonl")


def test_a_bias_run_records_loads_and_resumes_exactly(tmp_path):
    balance = ["--router_balance", "both", "--router_bias_rate", "0.01", "--save_interval", "2"]
    proc, whole = _pretrain(tmp_path, "a", *balance, "--max_steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MoE experts: torch's grouped matmul" in proc.stdout or "MoE experts: a loop" in proc.stdout
    records = read_metrics(whole)
    for record in records:  # every position routed to 2 experts: 2 micro-batches x 4 rows x 32 positions x 2
        for layer in (0, 1):
            low, high = record[f"expert_tokens_min/layer{layer}"], record[f"expert_tokens_max/layer{layer}"]
            assert 0 <= low <= 2 * 4 * 32 * 2 / 4 <= high <= 2 * 4 * 32
    stop_at_2 = ["--max_steps", "4", "--max_tokens", str(records[1]["tokens"])]  # the lr schedule's length kept
    proc, part = _pretrain(tmp_path, "b", *balance, *stop_at_2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = _pretrain(tmp_path, "b", "--max_steps", "4", "--from_resume", "1")  # the aux-only default
    assert proc.returncode == 2 and "--router_balance both" in proc.stderr + proc.stdout
    proc, part = _pretrain(tmp_path, "b", *balance, "--max_steps", "4", "--from_resume", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("expert_tokens_min/layer0", "expert_tokens_max/layer0", "expert_tokens_max/layer1"):
        assert [r[key] for r in resumed] == [r[key] for r in records], key  # the bias came back: the same routing
    for a, b in zip(records, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)  # test_train_pretrain's resume bound
