"""trainer/plan/config_file.py: --config YAML holds flags by their names, the command line wins, bad entries are
argparse's one usage line; a real run from a YAML file equals the same flags typed, and the YAML the run writes repeats
it."""
import argparse
import os

import pytest
import yaml

from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics
from trainer.plan.config_file import config_argv, run_config_text
from trainer.plan.flags import add_train_args
from trainer.plan.stage import Stage
from trainer.stages.dpo import DPOPlan

SCRIPT = "trainer/train_pretrain.py"


def parse(argv, stage=Stage):
    parser = add_train_args(argparse.ArgumentParser(), stage)
    return parser.parse_args(config_argv(parser, argv))


def test_file_flags_equal_typed_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-3\nbatch_size: 3\nuse_moe: 1\ntp: 2\nuse_wandb: true\n"
                      "lr_schedule: wsd\npacking: false\nmin_lr: null\n")
    from_file = vars(parse(["--config", str(config)]))
    typed = vars(parse(["--learning_rate", "1e-3", "--batch_size", "3", "--use_moe", "1", "--tp", "2", "--use_wandb",
                        "--lr_schedule", "wsd", "--packing", "0"]))
    assert from_file == dict(typed, config=str(config))
    assert parse(["--config", str(config), "--batch_size", "5"]).batch_size == 5  # typed after the file: it wins
    assert parse(["--batch_size", "5", "--config", str(config)]).batch_size == 5  # wherever --config stands


def test_the_written_config_repeats_every_flag(tmp_path):
    """run_config_text(flags) read back by --config gives the same flags, stage flags included (DPO's here)."""
    args = parse([*TINY_MODEL, "--learning_rate", "3e-4", "--eps", "1e-6", "--grad_checkpointing", "attention",
                  "--from_resume", "auto", "--data_path", "a.jsonl:0.7,b.jsonl:0.3", "--beta", "0.2"], DPOPlan)
    (tmp_path / "c.yaml").write_text(run_config_text(vars(args)))
    again = parse(["--config", str(tmp_path / "c.yaml")], DPOPlan)
    assert vars(again) == dict(vars(args), config=str(tmp_path / "c.yaml"))
    assert "config" not in yaml.safe_load(run_config_text(vars(again)))


@pytest.mark.parametrize("text,needle", [
    ("no_such_flag: 1\n", "no_such_flag is not a flag of this script"),
    ("use_moe: 2\n", "use_moe: 2 is not one of 0, 1"),
    ("batch_size: many\n", "batch_size: 'many' is not a valid int (invalid literal for int() with base 10: 'many')"),
    ('learning_rate: 1e-4\nmax_steps: "ten"\n', "max_steps: 'ten' is not a valid int"),
    ("- a list\n", "expected `flag_name: value` lines"),
    ("batch_size: 2\na: [\n",
     "not a readable YAML file (line 3: expected the node content, but found '<stream end>')")])
def test_bad_config_files_are_one_usage_error_naming_file_and_key(tmp_path, capsys, text, needle):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["--config", str(tmp_path / "bad.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and f"--config {tmp_path / 'bad.yaml'}: {needle}" in err[-1], err


def test_a_yaml_run_equals_the_typed_run_and_its_written_config_repeats_it(tmp_path):
    data = demo_slice(tmp_path, "pretrain", 48)
    flags = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps",
             "2", "--max_steps", "3", "--learning_rate", "2e-3", "--warmup_steps", "1", "--log_interval", "1"]

    def outputs(name):
        return ["--save_dir", str(tmp_path / name), "--checkpoint_dir", str(tmp_path / name / "ckpt"),
                "--metrics_file", str(tmp_path / name / "m.jsonl")]
    typed = forked(SCRIPT, flags + outputs("typed"))
    assert typed.returncode == 0, typed.stderr[-3000:]
    entries = {flags[i][2:]: flags[i + 1] for i in range(0, len(flags), 2)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(entries))
    from_file = forked(SCRIPT, ["--config", str(tmp_path / "run.yaml"), *outputs("file")])
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    written = tmp_path / "file" / "ckpt" / "pretrain_64_config.yaml"
    repeat = tmp_path / "repeat.yaml"  # the run's own record, sent elsewhere
    repeat.write_text(written.read_text().replace(str(tmp_path / "file"), str(tmp_path / "again")))
    again = forked(SCRIPT, ["--config", str(repeat)])
    assert again.returncode == 0, again.stderr[-3000:]
    runs = [read_metrics(str(tmp_path / name / "m.jsonl")) for name in ("typed", "file", "again")]
    assert [r["step"] for r in runs[0]] == [1, 2, 3]
    for records in runs[1:]:
        assert [(r["loss"], r["lr"], r["tokens"]) for r in records] == [(r["loss"], r["lr"], r["tokens"])
                                                                        for r in runs[0]]
    assert yaml.safe_load(written.read_text())["learning_rate"] == 2e-3
    assert os.path.isfile(tmp_path / "again" / "ckpt" / "pretrain_64_config.yaml")
