"""trainer/core/loop.py in one process: the effective log interval, steps per epoch, the host reads of a step."""
import argparse
import copy
import os
import re
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.core.build import build_trainer, setup, steps_per_epoch
from trainer.core.evaluation import evaluate
from trainer.core.loop import train_step
from trainer.observe.console import Bar, effective_log_interval, step_record
from trainer.observe.metrics import StepTimer
from trainer.plan.flags import add_train_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("log_interval,steps,expected", [
    (None, 6, 1),  # the full-size default run: 6 steps an epoch, so every step is logged, not only the last
    (None, 250, 25),  # a tenth of the epoch
    (None, 5000, 100),  # MiniMind's 100
    (10, 96, 10),  # a typed interval as typed (it was min(10, 96 // 10) = 9: the small run logged every 9 steps)
    (100, 6, 100),
    (1, 3, 1),
])
def test_a_record_at_least_every_tenth_of_an_epoch_unless_typed(log_interval, steps, expected):
    plan = SimpleNamespace(schedule=SimpleNamespace(log_interval=log_interval))
    assert effective_log_interval(plan, steps) == expected


def test_steps_per_epoch_drops_the_partial_global_batch():
    assert steps_per_epoch(SimpleNamespace(data=SimpleNamespace(global_batch=8)), list(range(60))) == 7


# every way Python code reads a tensor's value or data-dependent size on the host (on CUDA, each waits for the device)
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.nonzero,
              torch.nonzero, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__index__}


def tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class DeviceValues(TorchDispatchMode):
    """Marks every tensor an op computes from a marked one (outputs, and inputs an in-place op writes), starting from
    what a CUDA run keeps on the device; backward and the optimizer's foreach kernels included."""

    def __init__(self, sources):
        super().__init__()
        self.marked = {}  # id -> weakref: tensors compare by value, not identity, so no set of them
        for t in sources:
            self.mark(t)

    def mark(self, t):
        self.marked[id(t)] = weakref.ref(t)

    def holds(self, t):
        ref = self.marked.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(self.holds(t) for t in tensors((args, kwargs))):
            written = [args[i] if i < len(args) else kwargs.get(spec.name) for i, spec in
                       enumerate(func._schema.arguments) if spec.alias_info is not None and spec.alias_info.is_write]
            for t in tensors((out, written)):
                self.mark(t)
        return out


class HostReads(TorchFunctionMode):
    """Counts the host reads (HOST_READS) of marked tensors, whichever function (ours or torch's) makes them."""

    def __init__(self, values):
        super().__init__()
        self.values, self.count = values, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and args and isinstance(args[0], torch.Tensor) and self.values.holds(args[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def device_reads(fn, sources):
    """How many times fn() reads on the host a value computed from `sources` (the device-resident tensors)."""
    values = DeviceValues(sources)
    reads = HostReads(values)
    with reads, values:
        fn()
    return reads.count


@pytest.mark.parametrize("use_moe,optimizer", [(0, "adamw"), (1, "adamw"), (0, "lamb"), (0, "lars")])
def test_a_step_reads_the_device_once(tmp_path, use_moe, optimizer):
    """A non-log optimizer step (2 micro-batches, packed rows with documents) reads a value computed on the device
    once, the guard's agreed decision (ARCHITECTURE.md: one host sync per optimizer step), plus, where torch has no
    grouped matmul, MoE's split sizes (one read per MoE layer and micro-batch). Counted by what is read, not who reads
    it: every host read of a tensor that
    depends on what a CUDA run keeps on the device (parameters, buffers, the optimizer's moments; the rows' token ids
    and positions), in our code or torch's. The target counts read the CPU labels, which the count leaves out; the
    progress bar reads the running loss once per micro-batch, on CPU only."""
    args = add_train_args(argparse.ArgumentParser()).parse_args([
        "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--batch_size", "2", "--accumulation_steps", "2", "--max_seq_len", "16",
        "--loss_chunk_size", "0", "--use_moe", str(use_moe), "--optimizer", optimizer, "--device", "cpu",
        "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")])
    plan, dims = setup(args)
    trainer = build_trainer(plan, dims, steps_per_epoch=10)
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, -1)  # two documents a row
    batches = [(ids, ids.clone(), positions) for ids in (torch.randint(3, 500, (2, 16), generator=g) for _ in range(2))]
    train_step(trainer, batches)  # the first step (lazy state, allocator) is not the one counted
    model = trainer.model_parts[0]
    moments = [t for state in trainer.optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]  # torch keeps the 0-dim step counts on the host
    sources = [*model.parameters(), *model.buffers(), *moments, *(ids for ids, _, _ in batches), positions]
    looped = use_moe and model.model.layers[0].mlp.expert_compute == "loop"  # grouped GEMMs read nothing
    expected = 1 + (2 * 2 if looped else 0)  # the guard; MoE's loop: 2 layers x 2 micro-batches
    assert device_reads(lambda: train_step(trainer, batches), sources) == expected
    bar = Bar(trainer)
    assert device_reads(lambda: train_step(trainer, batches, bar), sources) == expected + 2  # CPU: the bar's 2 reads
    bar.close()


def tiny_trainer(tmp_path, *argv):
    args = add_train_args(argparse.ArgumentParser()).parse_args([
        "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--device", "cpu", "--batch_size", "2", "--accumulation_steps", "2",
        "--max_seq_len", "16", "--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
        "--cache_dir", str(tmp_path / "cache"), "--log_dir", "none", *argv])
    plan, dims = setup(args)
    return build_trainer(plan, dims, steps_per_epoch=10)


def random_batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids.clone()) for ids in (torch.randint(3, 500, (2, 16), generator=g) for _ in range(n))]


def test_the_record_has_the_gradient_norm_before_clipping(tmp_path):
    """The record's grad_norm is the step's gradient norm before clipping: a copy of the model, the step's loss
    (every micro-batch's CE sum over the step's target tokens) backpropagated by plain autograd, float64 norm."""
    trainer = tiny_trainer(tmp_path, "--grad_clip", "0.5")
    reference = copy.deepcopy(trainer.model_parts[0])
    batches = random_batches()
    metrics = train_step(trainer, batches)
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
    for ids, labels in batches:
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        reference(ids, shift_labels=targets, num_items_in_batch=num_items).loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad.double() for p in reference.parameters() if p.grad is not None])
    record = step_record(trainer, metrics, StepTimer(1.0))
    assert record["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert record["grad_clipped"] is (float(norm) > 0.5) is True
    big = tiny_trainer(tmp_path, "--grad_clip", str(10 * float(norm)))
    assert step_record(big, train_step(big, batches), StepTimer(1.0))["grad_clipped"] is False


def test_dropout_reaches_the_model_and_leaves_eval_alone(tmp_path):
    """--dropout 0.5: training forwards drop activations; evaluate() runs without: its loss is a dropout-free copy's
    CE over the targets, by hand."""
    trainer = tiny_trainer(tmp_path, "--dropout", "0.5", "--packing", "1")  # full rows, as pretraining's default
    model = trainer.model_parts[0]
    assert model.config.dropout == 0.5 and {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.5}
    ids = random_batches(1)[0][0]
    assert not torch.equal(model(ids).logits, model(ids).logits)  # train mode: two different masks
    plain = MiniMindForCausalLM(MiniMindConfig(**dict(model.config.to_dict(), dropout=0.0)))
    plain.load_state_dict(model.state_dict())
    eval_ds = [(row, row.clone()) for ids, _ in random_batches(2, seed=1) for row in ids]
    got = evaluate(trainer, eval_ds)["eval_loss"]
    with torch.no_grad():
        logits = plain(torch.stack([row for row, _ in eval_ds])).logits
        want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), torch.stack(
            [row for row, _ in eval_ds])[:, 1:].flatten())
    assert got == pytest.approx(float(want), rel=1e-5)


def test_deterministic_switches_torch_to_deterministic_kernels(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        tiny_trainer(tmp_path, "--deterministic", "1")
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_the_bar_shows_the_log_lines_loss_under_data_parallel(tmp_path):
    """2 ranks: the bar's loss at a step's end is the step loss summed over the ranks (the guard's all-reduce), the
    log line's, not rank 0's share (which was about half of it)."""
    data = demo_slice(tmp_path, "pretrain", 100)
    out = str(tmp_path / "out")
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--data_path", data, "--packing", "0", "--max_seq_len", "32", "--batch_size", "2",
        "--accumulation_steps", "2", "--max_steps", "3", "--log_interval", "1", "--save_dir", out, "--checkpoint_dir",
        os.path.join(out, "ckpt"), "--metrics_file", os.path.join(out, "m.jsonl")], 2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the final bar (3 steps x 2 micro-batches); a slow machine may draw 6/6 once more before the step's loss is set
    final = re.findall(r"\| 6/6 .*?loss=([0-9.]+), lr=", proc.stderr)
    records = read_metrics(os.path.join(out, "m.jsonl"))
    assert final and final[-1] == f"{records[-1]['loss']:.4f}", (final, records[-1]["loss"], proc.stderr[-2000:])
