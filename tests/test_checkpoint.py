"""trainer/ckpt/resume.py: DCP resume directories (round trip, manifest, pruning), a damaged MiniMind resume file,
the retired formats 1/2, TrainState, atomic saves (MiniMind's resume file itself: tests/test_minimind_resume.py)."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from model.atomic import atomic_save
from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, read_metrics, spawn
from trainer.ckpt.checkpointer import Checkpointer
from trainer.ckpt.parts import SHARDED, Part, standard_parts
from trainer.ckpt.resume import TrainState, check_config, read_checkpoint_model, read_resume
from trainer.ckpt.step_dirs import MANIFEST, latest_checkpoint, rng_state, set_rng_state
from trainer.parallel.state_dict import load_sharded_state, sharded_state_dict
from trainer.plan.objective import LMObjective
from trainer.runtime.callbacks import Callbacks

EMA_START = "EMA starts from the restored weights"


def tiny_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return MiniMindConfig(**dict(base, **kw))


def resume_plan(tmp_path, micro_batch=4, global_batch=8, from_resume="1"):
    """The TrainPlan's sections load_resume reads."""
    return SimpleNamespace(io=SimpleNamespace(checkpoint_dir=str(tmp_path), run_dir=str(tmp_path / "pretrain_64"),
                                              from_resume=from_resume, resume_path=None),
                           data=SimpleNamespace(micro_batch=micro_batch, global_batch=global_batch),
                           model=SimpleNamespace(dtype=torch.float32))


def test_corrupt_resume_file_is_one_clear_error(tmp_path):
    with open(tmp_path / "pretrain_64_resume.pth", "wb") as f:
        f.write(b"PK\x03\x04 truncated garbage")
    with pytest.raises(ConfigError, match="pretrain_64_resume.pth is not a readable resume file"):
        read_resume(tiny_config(), resume_plan(tmp_path))


@pytest.mark.parametrize("old", [dict(format_version=2, train_state={}), dict(format_version=1, step_in_epoch=3)])
def test_format_1_and_2_files_name_the_commit_that_reads_them(tmp_path, old):
    rng = dict(numpy=np.random.get_state(), torch=torch.get_rng_state())  # what those files held beside the model
    torch.save(dict(model={"w": torch.ones(2)}, optimizer={}, epoch=0, rng=rng, **old),
               tmp_path / "pretrain_64_resume.pth")
    with pytest.raises(ConfigError, match="format 1/2 single-file checkpoints were read up to commit 4df0373"):
        read_resume(tiny_config(), resume_plan(tmp_path))


KILL_MIDWAY = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
from model.atomic import atomic_save
real_save = torch.save
def save_then_die(obj, f, *a, **k):
    real_save(obj, f, *a, **k)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before fsync/rename
torch.save = save_then_die
atomic_save({"w": torch.ones(1000, 1000)}, sys.argv[2])
"""


def test_killed_save_leaves_previous_file(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = str(tmp_path / "train_state.pt")
    atomic_save({"w": torch.zeros(2)}, path)
    (tmp_path / "kill_midway.py").write_text(KILL_MIDWAY)
    proc = forked(str(tmp_path / "kill_midway.py"), [root, path], timeout=120)  # forked: torch imported already
    assert proc.returncode == -9  # really killed midway
    assert torch.equal(torch.load(path)["w"], torch.zeros(2))  # the old one, intact


def test_train_state_round_trip():
    state = TrainState(epoch=1, step_in_epoch=2, global_step=7, tokens_seen=1234, tracker_id="run-x")
    saved = state.state_dict()
    assert saved == dict(epoch=1, step_in_epoch=2, global_step=7, tokens_seen=1234, tracker_id="run-x")
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert fresh == state


def trained(config, seed, steps=2, weight_decay=0.01):
    """A model and AdamW after `steps` real steps on random tokens (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 16))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _tp_save_worker(rank, world_size, path):
    """The seeded tiny model, tensor-parallel over the two ranks (DTensor shards), saved as the trainer saves it."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.tensor import apply_tensor_parallel
    torch.manual_seed(0)
    model = apply_tensor_parallel(MiniMindForCausalLM(tiny_config()), init_device_mesh("cpu", (2,), mesh_dim_names=(
        "tp",)), False, False)
    dcp.save(sharded_state_dict([model], torch.optim.AdamW(model.parameters())), checkpoint_id=path)
    if rank == 0:
        atomic_save(dict(config=tiny_config().to_dict(), args=dict(tokenizer_path="model")),
                    os.path.join(path, "train_state.pt"))


@pytest.mark.slow
def test_a_tensor_parallel_step_directory_reads_as_the_full_model(tmp_path):
    """read_checkpoint_model (convert_model, eval_llm --checkpoint, --from_weight) gathers every rank's shards in one
    process: the same tensors as the seeded model before it was split."""
    spawn(_tp_save_worker, 2, str(tmp_path / "step_1"), timeout=120, start_method="fork")
    state_dict, config, args = read_checkpoint_model(str(tmp_path / "step_1"))
    torch.manual_seed(0)
    want = MiniMindForCausalLM(tiny_config()).state_dict()
    assert state_dict.keys() == want.keys() and all(torch.equal(state_dict[k], want[k]) for k in want)
    assert config["hidden_size"] == 64 and args == dict(tokenizer_path="model")


def test_sharded_state_round_trip_is_exact(tmp_path):
    """dcp.save of sharded_state_dict, load_sharded_state into another model: weights and AdamW state equal."""
    config = tiny_config()
    model, optimizer = trained(config, seed=0)
    dcp.save(sharded_state_dict([model], optimizer), checkpoint_id=str(tmp_path / "step_2"))
    fresh, fresh_optimizer = trained(config, seed=1, steps=1)  # other weights, other state, step count 1
    load_sharded_state([fresh], fresh_optimizer, str(tmp_path / "step_2"))
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), name
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def make_steps(run_dir, steps, complete):
    for step in steps:
        os.makedirs(os.path.join(run_dir, f"step_{step}"))
        if step in complete:
            with open(os.path.join(run_dir, f"step_{step}", MANIFEST), "w") as f:
                json.dump({"step": step}, f)


def test_newest_complete_checkpoint_and_pruning(tmp_path):
    """Only a directory with its manifest counts; after a save at step 8, keep 2 leaves steps 6 and 8: partial saves
    (7), older ones (2, 4) and an abandoned later timeline (12, from an earlier run in the same directory) go."""
    run_dir = str(tmp_path / "pretrain_64")
    make_steps(run_dir, [2, 4, 6, 7, 8, 12], complete=[2, 4, 6, 8, 12])
    assert latest_checkpoint(run_dir) == os.path.join(run_dir, "step_12")
    Checkpointer(run_dir, keep=2).prune(8)
    assert sorted(os.listdir(run_dir)) == ["step_6", "step_8"]
    make_steps(str(tmp_path / "all"), [1, 2, 3, 9], complete=[1, 3, 9])
    Checkpointer(str(tmp_path / "all"), keep=0).prune(3)  # keep everything complete up to the save
    assert sorted(os.listdir(tmp_path / "all")) == ["step_1", "step_3"]
    make_steps(str(tmp_path / "partial"), [5], complete=[])
    assert latest_checkpoint(str(tmp_path / "partial")) is None


def test_from_resume_1_without_a_checkpoint_is_refused_and_auto_starts_fresh(tmp_path):
    config = tiny_config()
    make_steps(str(tmp_path / "pretrain_64"), [3], complete=[])  # a save killed before its manifest
    with pytest.raises(ConfigError, match="--from_resume 1 but .*pretrain_64 holds no complete checkpoint"):
        read_resume(config, resume_plan(tmp_path, from_resume="1"))
    assert read_resume(config, resume_plan(tmp_path, from_resume="auto")) is None
    assert read_resume(config, resume_plan(tmp_path, from_resume="0")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.py runs it)")
def test_cuda_rng_state_is_the_current_devices_only():
    """A checkpoint holds the current GPU's RNG state, so it resumes on fewer GPUs; an older one with every visible
    GPU's state (8 here) restores this device's entry instead of raising IndexError for the devices it lacks."""
    torch.cuda.init()
    state = rng_state()
    assert torch.is_tensor(state["cuda"]) and torch.equal(state["cuda"], torch.cuda.get_rng_state())
    expected = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    set_rng_state(dict(state, cuda=[state["cuda"]] * 8))
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_from_resume_a_chosen_step_directory(tmp_path):
    """--from_resume <step dir>: an older checkpoint of the run continues it (the same steps again, bit for bit), the
    later ones of the abandoned timeline go at its first save; a folder that is no complete checkpoint is one line."""
    data = demo_slice(tmp_path, "pretrain", 48)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [*TINY_MODEL, "--data_path", data, "--max_seq_len", "32", "--batch_size", "2", "--accumulation_steps", "2",
            "--max_steps", "4", "--save_interval", "1", "--keep_checkpoints", "0", "--log_interval", "1",
            "--save_dir", str(out), "--checkpoint_dir", str(ckpt), "--metrics_file", str(out / "m.jsonl")]
    first = forked("trainer/train_pretrain.py", args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = read_metrics(str(out / "m.jsonl"))
    run_dir = ckpt / "pretrain_64"
    later = {step: os.path.getmtime(run_dir / f"step_{step}" / "complete.json") for step in (3, 4)}
    again = forked("trainer/train_pretrain.py", [*args, "--from_resume", str(run_dir / "step_2")])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Resuming from {run_dir / 'step_2'}" in again.stdout and "Resumed from epoch 0, step 2" in again.stdout
    after = read_metrics(str(out / "m.jsonl"))
    assert [r["step"] for r in after] == [1, 2, 3, 4]  # the metrics file cut back to step 2, then steps 3-4 again
    assert [(r["loss"], r["tokens"], r["lr"]) for r in after] == [(r["loss"], r["tokens"], r["lr"]) for r in before]
    assert all(os.path.getmtime(run_dir / f"step_{s}" / "complete.json") > t for s, t in later.items())  # rewritten
    for bad in (run_dir, tmp_path / "none"):
        proc = forked("trainer/train_pretrain.py", [*args, "--from_resume", str(bad)], timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            f"error: --from_resume {bad}: not a complete checkpoint (a step_<N> directory with complete.json); "
            "pass 0, 1, auto or such a directory")


def registry_plan(tmp_path):
    """The plan sections Checkpointer.train_state and read_resume read, for one process."""
    layout = SimpleNamespace(world_size=1, dp=1, tp=1, pp=1, cp=1, zero_stage=0,
                             model_sizes=dict(pp=1, cp=1, tp=1, ep=1))
    io = SimpleNamespace(checkpoint_dir=str(tmp_path), run_dir=str(tmp_path / "pretrain_64"), from_resume="1",
                         resume_path=None)
    return SimpleNamespace(io=io, layout=layout, flags={}, stage=SimpleNamespace(resume_fields=dict),
                           data=SimpleNamespace(global_batch=8, tokenizer_record=None),
                           model=SimpleNamespace(config=SimpleNamespace(use_moe=False)),
                           optim=SimpleNamespace(name="adamw"))


def ema_part(model, start=EMA_START):
    """docs/checkpoints.md's example: EMA weights, a sharded part (DCP shards, resharded like the model); a
    checkpoint without them starts them from the restored weights."""
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}

    def load(ckpt):
        dcp.load({"ema": ema}, checkpoint_id=ckpt["dcp_path"])

    def begin():
        for name, p in model.named_parameters():
            ema[name].copy_(p.detach())

    part = Part("ema", SHARDED, lambda: {"ema": ema}, load, start=start, begin=begin)
    part.values = ema
    return part


def registered(config, seed, plan):
    """A trained model and AdamW with the standard parts of a Checkpointer."""
    model, optimizer = trained(config, seed)
    scaler, progress = torch.amp.GradScaler("cpu", enabled=False), TrainState(global_step=2, tokens_seen=99)
    parts = standard_parts([model], optimizer, None, scaler, progress, LMObjective(), Callbacks())
    return model, optimizer, progress, Checkpointer(plan.io.run_dir, keep=0, parts=parts, plan=plan,
                                                    config=config)


def test_a_part_added_later_starts_from_its_start_value_and_one_without_is_refused(tmp_path, capsys):
    """A checkpoint saved before a part existed (here: EMA weights, registered by the later run) loads with one note,
    the part at its start value (the restored weights), everything else exactly as saved; the same without a start
    value is refused in one line. A checkpoint from before parts were listed (no "parts" key) reads as the legacy
    set. A part saved and restored round-trips bitwise, also when it is registered after the load."""
    config, plan = tiny_config(), registry_plan(tmp_path)
    model, optimizer, _, old = registered(config, 0, plan)
    old.save(2)
    path = str(tmp_path / "pretrain_64" / "step_2")
    saved = torch.load(os.path.join(path, "train_state.pt"), weights_only=True)
    assert saved["parts"] == {"model": "sharded", "rng": "per rank", "objective": "per rank",
                              "powersgd": "per rank", "scaler": "rank 0", "train_state": "rank 0",
                              "callbacks": "rank 0"}
    atomic_save({k: v for k, v in saved.items() if k != "parts"}, os.path.join(path, "train_state.pt"))  # legacy
    with open(os.path.join(path, "complete.json")) as f:  # and its manifest, written before sizes and sums were
        manifest = {k: v for k, v in json.load(f).items() if k not in ("files", "crc32")}
    with open(os.path.join(path, "complete.json"), "w") as f:
        json.dump(manifest, f)

    fresh, fresh_optimizer, progress, new = registered(config, 1, plan)
    ema = ema_part(fresh)
    new.register(ema)
    capsys.readouterr()
    new.load(read_resume(config, plan))
    assert f"note: {path} holds no 'ema' state (saved before that part existed); {EMA_START}" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert progress == TrainState(global_step=2, tokens_seen=99)
    assert all(torch.equal(ema.values[n], p) for n, p in model.named_parameters())  # the start value
    for (name, a), b in zip(optimizer.state_dict()["state"].items(), fresh_optimizer.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a), name

    strict, *_, refusing = registered(config, 1, plan)
    refusing.register(ema_part(strict, start=None))
    with pytest.raises(ConfigError) as refused:
        refusing.load(read_resume(config, plan))
    assert str(refused.value) == (f"{path} holds no 'ema' state (saved before that part existed) and it has no start "
                                  "value, so the run cannot continue exactly; resume with the trainer that saved it, "
                                  "or pass --from_resume 0 --overwrite 1 to start over")

    for values in ema.values.values():
        values.mul_(0.5)  # EMA weights unlike the model's
    new.save(3)
    late_model, *_, late = registered(config, 2, plan)
    late.load(read_resume(config, plan))
    late_ema = ema_part(late_model)
    late.register(late_ema)  # after the load: restored at once
    assert all(torch.equal(late_ema.values[n], v) for n, v in ema.values.items())


def test_a_resume_with_another_vocabulary_names_the_tokenizer_not_a_flag():
    """No flag sets vocab_size (the tokenizer does): a checkpoint of another vocabulary says which tokenizer to pass."""
    saved = tiny_config(vocab_size=8000).to_dict()
    with pytest.raises(ConfigError) as caught:
        check_config(saved, tiny_config(), "ck/step_2", {"path": "/data/tok8000", "sha256": "ab"})
    assert str(caught.value) == ("ck/step_2 was saved with vocab_size=8000 but this run has vocab_size=6400; "
                                 "vocab_size follows the tokenizer: pass --tokenizer_path /data/tok8000 or pass "
                                 "--from_resume 0")
    with pytest.raises(ConfigError, match="hidden_size=64 but this run has hidden_size=128; match the flags or pass"):
        check_config(saved, tiny_config(hidden_size=128, vocab_size=8000), "ck/step_2")
