"""trainer/plan/resolve.py: the resolved TrainPlan (layout rule, paths, batch) and the flags' help."""
import argparse
import dataclasses
import os

import pytest
import torch

from model.errors import ConfigError
from model.model_minimind import MiniMindForCausalLM
from model.weights.paths import ROOT
from trainer.plan.checks import data_parallel_mode
from trainer.plan.flags import FlagParser, add_train_args, declared_flags
from trainer.plan.model_config import build_config
from trainer.plan.resolve import TrainPlan, resolve

HERE = os.path.dirname(os.path.abspath(__file__))  # a folder: no tokenizer, no weights, not a data file
FORBIDDEN = "/proc/forbidden"  # a folder no one can create
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--dtype", "float32", "--device", "cpu"]


def flags(*argv):
    return add_train_args(argparse.ArgumentParser()).parse_args([*TINY, *argv])


@pytest.mark.parametrize("world,layout,expected", [
    (1, {}, (1, 0, "none")),
    (2, {}, (2, 0, "ddp")),
    (2, dict(tp=2), (1, 0, "none")),  # no data-parallel group: the typed stage stays
    (8, dict(tp=2, pp=2), (2, 2, "fsdp2")),  # tp/pp with dp > 1: FSDP2
    (4, dict(tp=2, cp=2), (1, 2, "fsdp2")),  # dp*cp > 1 counts, not dp alone
    (4, dict(pp=2, cp=2), (1, 2, "fsdp2")),
    (4, dict(cp=2, zero_stage=1), (2, 1, "zero1")),
    (2, dict(zero_stage=3), (2, 3, "fsdp2")),
])
def test_data_parallel_mode(world, layout, expected):
    assert data_parallel_mode(world, **layout) == expected


def test_data_parallel_mode_rejects_with_one_line():
    with pytest.raises(ConfigError, match="not divisible by pp\\*cp\\*tp"):
        data_parallel_mode(6, tp=4)
    with pytest.raises(ConfigError, match="cannot be combined with --tp 2"):  # a DDP hook keeps DDP: refused
        data_parallel_mode(4, tp=2, grad_compression="bf16")


def test_resolve_is_frozen_and_leaves_args_as_typed():
    args = flags("--tp", "2", "--pp", "2", "--batch_size", "3", "--accumulation_steps", "4", "--max_seq_len", "64")
    typed = dict(vars(args))
    plan = resolve(args, 8)
    assert vars(args) == typed  # nothing written back
    layout = plan.layout
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.zero_stage, layout.dp_mode) == (2, 2, 2, 1, 2, "fsdp2")
    assert plan.data.global_batch == 3 * 4 * 2 and plan.micro_batch_shape == (3, 64)
    assert plan.model.dtype == torch.float32 and plan.model.autocast_dtype is None and plan.layout.has_dtensor
    assert not plan.model.chunked_loss  # tp: vocab-sharded logits
    assert resolve(flags(), 1).model.chunked_loss and resolve(flags("--cp", "2"), 2).micro_batch_shape == (32, 170)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout.dp = 4
    assert isinstance(plan, TrainPlan)


def test_paths_typed_against_cwd_defaults_against_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    plan = resolve(flags("--save_dir", "mine", "--data_path", "d.jsonl"), 1)
    assert plan.io.save_dir == str(tmp_path / "mine") and plan.data.data_path == str(tmp_path / "d.jsonl")
    assert plan.io.metrics_file == str(tmp_path / "mine" / "pretrain_64_metrics.jsonl")  # keyed by the weight name
    assert plan.io.checkpoint_dir == os.path.join(ROOT, "checkpoints")
    assert plan.data.tokenizer_path == os.path.join(ROOT, "model")
    assert plan.data.cache_dir == os.path.join(ROOT, "dataset", ".cache")
    moe = resolve(flags("--save_dir", "mine", "--use_moe", "1", "--save_weight", "w"), 1)
    assert moe.io.metrics_file == str(tmp_path / "mine" / "w_64_moe_metrics.jsonl")
    assert resolve(flags(), 1).io.save_dir == os.path.join(ROOT, "out")


def test_resolve_creates_nothing_and_names_the_run_once(tmp_path):
    out, ckpt = tmp_path / "a" / "out", tmp_path / "b" / "ckpt"
    plan = resolve(flags("--save_dir", str(out), "--checkpoint_dir", str(ckpt), "--cache_dir", str(tmp_path / "c"),
                         "--use_moe", "1", "--save_weight", "w", "--learning_rate", "3e-4"), 1)
    assert sorted(os.listdir(tmp_path)) == []  # checked, not made: the folders come with the first write
    assert (plan.io.run_name, plan.io.weights_path, plan.io.run_dir) == ("w_64_moe", str(out / "w_64_moe.pth"),
                                                                         str(ckpt / "w_64_moe"))
    assert plan.lr.peak == 3e-4 and plan.flags["learning_rate"] == 3e-4 and plan.flags["save_weight"] == "w"
    assert plan.model.config.hidden_size == 64 and plan.model.config.use_moe


def test_profile_steps_and_model_sizes():
    assert resolve(flags("--profile_steps", "3:5"), 1).io.profile_steps == (3, 5)
    with pytest.raises(ConfigError, match="--profile_steps"):
        resolve(flags("--profile_steps", "5:3"), 1)
    with pytest.raises(ConfigError, match="A:B"):
        resolve(flags("--profile_steps", "x"), 1)
    # the model the size flags build, counted by hand: h 64, 2 layers, 4 heads of 16, 2 kv heads, MLP 96, V 6400
    config = build_config(flags("--intermediate_size", "96"))
    h, kv, mlp, vocab = 64, 2 * 16, 96, 6400
    layer = h * h + 2 * h * kv + h * h + 3 * h * mlp + 2 * h + 2 * 16  # q, k, v, o, MLP, 2 norms, q/k norms
    model = MiniMindForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 2 * layer + vocab * h + h  # tied lm_head, final norm
    assert (config.head_dim, config.intermediate_size) == (16, 96)


def test_every_flag_has_help():
    parser = add_train_args(argparse.ArgumentParser())
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert missing == []


@pytest.mark.parametrize("args,needle", [
    (["--learning_rate", "-1"], "--learning_rate must be a finite number, 0 or more (got -1.0)"),
    (["--learning_rate", "nan"], "--learning_rate must be a finite number, 0 or more (got nan)"),
    (["--grad_clip", "-1"], "--grad_clip must be a positive number (got -1.0)"),
    (["--grad_clip", "0"], "--grad_clip must be a positive number (got 0.0)"),
    (["--weight_decay", "-0.1"], "--weight_decay must be a finite number, 0 or more"),
    (["--max_steps", "-3"], "--max_steps must be at least 0 (got -3; 0 runs all epochs)"),
    (["--warmup_steps", "-1"], "--warmup_steps must be at least 0"),
    (["--seed", "-1"], "--seed must be at least 0"),
    (["--seed", str(2 ** 32)], "--seed must be below 2**32"),
    (["--num_workers", "-1"], "--num_workers must be at least 0"),
    (["--eval_interval", "-1"], "--eval_interval must be at least 0"),
    (["--eval_batches", "0"], "--eval_batches must be at least 1"),
    (["--loss_chunk_size", "-1"], "--loss_chunk_size must be at least 0"),
    (["--dist_timeout", "0"], "--dist_timeout must be at least 1"),
    (["--hidden_size", "0"], "--hidden_size must be at least 1"),
    (["--num_hidden_layers", "0"], "--num_hidden_layers must be at least 1"),
    (["--num_attention_heads", "0"], "--num_attention_heads must be at least 1"),
    (["--intermediate_size", "0"], "--intermediate_size must be at least 1"),
    (["--head_dim", "0"], "--head_dim must be at least 1"),
    (["--use_moe", "1", "--num_experts_per_tok", "0"], "--num_experts_per_tok must be at least 1"),
    (["--grace_seconds", "0"], "--grace_seconds must be a positive number"),
    (["--max_bad_steps", "0"], "--max_bad_steps must be at least 1"),
    (["--check_replicas", "-1"], "--check_replicas must be at least 0"),
    (["--device", "gpu"], "--device gpu is not a device"),
    (["--tokenizer_path", "/nonexistent/tokenizer"], "--tokenizer_path /nonexistent/tokenizer is not a directory"),
    (["--tokenizer_path", HERE], "has no tokenizer.json"),
    (["--checkpoint_dir", FORBIDDEN], "--checkpoint_dir /proc/forbidden is not writable"),
    (["--cache_dir", FORBIDDEN], "--cache_dir /proc/forbidden is not writable"),
    (["--tensorboard_dir", FORBIDDEN], "--tensorboard_dir /proc/forbidden is not writable"),
    (["--metrics_file", HERE], "is a directory; pass a file path"),
    (["--data_path", HERE], "is a directory with no data file"),  # a directory of data files is a source
    (["--eval_data_path", "/nonexistent/eval.jsonl"], "does not exist"),
    (["--from_weight", HERE], "has no config.json"),
    (["--zero_stage", "5"], "--zero_stage must be one of 0, 1, 2, 3"),
    (["--profile_steps", "0:2"], "--profile_steps"),
    (["--min_lr", "1"], "--min_lr must be between 0 and the peak lr 0.0005 (got 1.0)"),
    (["--lr_scaling", "sqrt"], "give --base_batch"),
    (["--wsd_decay_fraction", "0"], "--wsd_decay_fraction must be in (0, 1]"),
    (["--beta1", "1"], "--beta1 must be in [0, 1) (got 1.0)"),
    (["--dropout", "1"], "--dropout must be in [0, 1) (got 1.0)"),
    (["--max_tokens", "-1"], "--max_tokens must be at least 0 (got -1; 0 is no token budget)"),
    (["--powersgd_start_step", "1"], "--powersgd_start_step must be at least 2"),
    (["--cpu_offload", "1"], "--cpu_offload 1 moves FSDP2's shards from the GPU to CPU memory"),
    (["--from_resume", HERE], "not a complete checkpoint (a step_<N> directory with complete.json)"),
    (["--early_stop_patience", "2"], "--early_stop_patience follows the eval loss: give --eval_data_path"),
    (["--tracker", "x"], "--tracker x: x is not one of"),
    (["--log_dir", FORBIDDEN], "--log_dir /proc/forbidden is not writable"),
    (["--expert_compute", "loop"], "--expert_compute loop runs MoE experts: add --use_moe 1"),
    (["--use_moe", "1", "--expert_compute", "grouped", "--tp", "2"], "--expert_compute grouped: tensor parallel"),
])
def test_bad_flag_values_are_config_errors(tmp_path, args, needle):
    with pytest.raises(ConfigError) as error:
        resolve(flags("--save_dir", str(tmp_path), *args), 1)
    assert needle in str(error.value)


def test_check_replicas_needs_replicated_parameters(tmp_path):
    with pytest.raises(ConfigError, match="--check_replicas compares replicated parameters"):
        resolve(flags("--save_dir", str(tmp_path), "--check_replicas", "1", "--zero_stage", "3"), 2)
    plan = resolve(flags("--save_dir", str(tmp_path), "--check_replicas", "1", "--zero_stage", "1"), 2)
    assert plan.layout.dp_mode == "zero1"  # ZeRO-1 keeps full replicated parameters


def test_every_integer_flag_has_a_range():
    """A new integer flag must say which values it takes: a min on its declaration, choices, or a layout check."""
    parser = add_train_args(argparse.ArgumentParser())
    ranged = {f.name for f in declared_flags() if f.min is not None}
    checked_elsewhere = {"tp", "pp", "cp", "zero_stage"}  # validate_layout / validate_data_parallel
    unchecked = [a.dest for a in parser._actions if a.type is int and not a.choices
                 and a.dest not in ranged and a.dest not in checked_elsewhere]
    assert unchecked == []


@pytest.mark.parametrize("argv,line", [
    (["--epcohs", "3"], "error: unknown flag --epcohs (did you mean --epochs?); --help lists every flag"),
    (["--epoch", "3"], "error: unknown flag --epoch (did you mean --epochs?); --help lists every flag"),  # no prefix
    (["--max_step=2"], "error: unknown flag --max_step (did you mean --max_steps?); --help lists every flag"),
    (["--zzz_qqq", "1"], "error: unknown flag --zzz_qqq; --help lists every flag"),
])
def test_an_unknown_flag_is_one_line_with_the_nearest_real_one(argv, line, capsys):
    """argparse took `--epoch 3` as --epochs (abbreviations) and met `--epcohs` with 66 lines of usage."""
    parser = add_train_args(FlagParser())
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([*TINY, *argv])
    assert stop.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_doc_mask_follows_packing():
    assert resolve(flags("--packing", "1"), 1).data.doc_mask  # on by default for packed rows
    assert resolve(flags("--packing", "1", "--cp", "2"), 2).data.doc_mask  # the ring masks by positions too
    assert not resolve(flags("--packing", "1", "--doc_mask", "0"), 1).data.doc_mask
    assert not resolve(flags(), 1).data.doc_mask  # one document per row: nothing to mask
