"""scripts/convert_model.py: exports load in transformers with the source's logits, imports give our model the same."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from transformers import __version__ as transformers_version

from model.export.gguf import read_gguf
from model.model_minimind import MiniMindForCausalLM
from scripts.convert_model import main as convert_main
from tests.helpers.disks import fill
from tests.helpers.launch import ROOT, TINY_MODEL, demo_slice, forked
from tests.helpers.weight_files import (
    VOCAB,
    hand_folded,
    lora_adapter,
    source_model,
    tiny,
    tiny_qwen3,
    write_minimind_folder,
)

TOL = 1e-4  # fp32: the two implementations differ only in summation order


def ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))


def logits_diff(model, folder, **kw):
    loaded = AutoModelForCausalLM.from_pretrained(folder, **kw).float().eval()
    with torch.no_grad():
        return (model(ids()).logits - loaded(ids()).logits).abs().max().item()


def custom_tokenizer(tmp_path):
    """model/'s tokenizer copied elsewhere and made distinguishable, as a run with --tokenizer_path would use."""
    tok = tmp_path / "my_tokenizer"
    shutil.copytree(os.path.join(ROOT, "model"), tok, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4242
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def resume_checkpoint(path, model, tokenizer_path):
    """A single-file checkpoint with model, config, typed args and numpy RNG state (formats 1/2; still exported)."""
    torch.save(dict(model=model.state_dict(), config=model.config.to_dict(), format_version=1,
                    args=dict(tokenizer_path=str(tokenizer_path), num_experts_per_tok=1),
                    rng=dict(numpy=np.random.get_state(), torch=torch.get_rng_state())), path)
    return path


@pytest.mark.parametrize("use_moe", [False, True])
def test_export_resume_checkpoint_with_its_tokenizer(tmp_path, capsys, use_moe):
    model = source_model(tiny(use_moe=use_moe, num_experts_per_tok=2, rope_theta=1e6))
    tok = custom_tokenizer(tmp_path)
    ckpt = resume_checkpoint(tmp_path / "pretrain_64_resume.pth", model, tok)
    out = tmp_path / "hf"
    assert convert_main(["--weight", str(ckpt), "--out_dir", str(out)]) == 0
    assert "verify: max abs logits diff" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf) is (Qwen3MoeForCausalLM if use_moe else Qwen3ForCausalLM)
    if use_moe:  # from the checkpoint's config, not the args' or the CLI's default of 1
        assert hf.config.num_experts_per_tok == 2
    assert logits_diff(model, out) <= TOL
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok / name).read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 4242


def test_exported_config_reads_rope_theta_under_this_transformers(tmp_path):
    model = source_model(tiny())
    torch.save({k: v.half() for k, v in model.state_dict().items()}, tmp_path / "pretrain_64.pth")  # as saved
    assert convert_main(["--weight", str(tmp_path / "pretrain_64.pth"), "--out_dir", str(tmp_path / "hf")]) == 0
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["rope_theta"] == 1e6 and raw["rope_parameters"]["rope_theta"] == 1e6  # 4.x and 5.x keys
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    read = config.rope_parameters["rope_theta"] if transformers_version.startswith("5.") else config.rope_theta
    assert read == 1e6


def test_format_minimind_loads_with_trust_remote_code(tmp_path):
    """Load the folder in a fresh interpreter, where only the folder's own modeling files can define the model: the MoE
    layer (model/moe.py) and YaRN (model/yarn.py, switched on after loading) come from the folder too."""
    model = source_model(tiny(use_moe=True, num_experts_per_tok=2, n_shared_experts=1))  # Qwen3-MoE cannot hold this
    ckpt = resume_checkpoint(tmp_path / "sft_resume.pth", model, os.path.join(ROOT, "model"))
    out = tmp_path / "mm"
    assert convert_main(["--weight", str(ckpt), "--out_dir", str(out), "--format", "minimind"]) == 0
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "model_minimind.MiniMindForCausalLM"
    torch.save(ids(), tmp_path / "ids.pt")
    script = ("import sys, torch; from transformers import AutoModelForCausalLM\n"
              "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).float().eval()\n"
              "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
              "with torch.no_grad(): torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])\n"
              "m.config.inference_rope_scaling = True\n"
              "with torch.no_grad(): torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[4])\n")
    subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"),
                    str(tmp_path / "yarn.pt")], check=True, cwd=tmp_path, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert sorted(p.name for p in out.glob("*.py")) == ["model_minimind.py", "moe.py", "yarn.py"]
    with torch.no_grad():
        assert (model(ids()).logits - torch.load(tmp_path / "logits.pt")).abs().max().item() <= TOL
        model.config.inference_rope_scaling = True
        assert (model(ids()).logits - torch.load(tmp_path / "yarn.pt")).abs().max().item() <= TOL


def test_import_minimind_format_folder(tmp_path):
    reference = tiny_qwen3(VOCAB)
    folder = write_minimind_folder(tmp_path / "minimind-3", reference)
    assert convert_main(["--to", "minimind", "--out_dir", str(folder), "--weight", str(tmp_path / "mm3.pth")]) == 0
    model = MiniMindForCausalLM(tiny(intermediate_size=256)).eval()
    model.load_state_dict(torch.load(tmp_path / "mm3.pth"), strict=True)
    assert json.loads((tmp_path / "mm3.json").read_text())["intermediate_size"] == 256  # its config beside it
    with torch.no_grad():
        assert (model(ids()).logits - reference(ids()).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("use_moe", [False, True])
def test_qwen3_round_trip_is_exact(tmp_path, use_moe):
    model = source_model(tiny(use_moe=use_moe, num_experts_per_tok=2))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    assert convert_main(["--weight", str(tmp_path / "w.pth"), "--out_dir", str(tmp_path / "hf"),
                         "--num_experts_per_tok", "2"]) == 0
    argv = ["--to", "minimind", "--out_dir", str(tmp_path / "hf"), "--weight", str(tmp_path / "b.pth")]
    assert convert_main(argv) == 0
    assert convert_main(argv) == 2  # an imported .pth is not replaced unasked either
    back, original = torch.load(tmp_path / "b.pth"), model.state_dict()
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)


def test_bad_input_is_one_error_line(tmp_path, capsys):
    model = source_model(tiny(use_moe=True, num_experts_per_tok=2))
    torch.save(model.state_dict(), tmp_path / "moe.pth")
    ckpt = resume_checkpoint(tmp_path / "r.pth", model, os.path.join(ROOT, "model"))
    cases = [(["--weight", str(tmp_path / "moe.pth")], "top-k is unknown; pass --num_experts_per_tok"),
             (["--weight", str(ckpt), "--num_experts_per_tok", "1"],
              "--num_experts_per_tok 1 (the weights have 2): the model is defined by the weights; drop the flag"),
             (["--weight", str(ckpt), "--hidden_size", "768"], "--hidden_size 768 (the weights have 64)"),
             (["--weight", str(ckpt), "--tokenizer_path", str(tmp_path)], "holds no tokenizer.json"),
             (["--weight", str(ckpt), "--rope_theta", "-5"], "--rope_theta must be a positive number (got -5.0)"),
             (["--weight", str(ckpt), "--num_experts", "0"], "--num_experts must be at least 1 (got 0)")]
    for argv, expected in cases:
        assert convert_main(argv + ["--out_dir", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and "\n" not in err, err
    (tmp_path / "a_file").write_text("")
    cases = [(["--weight", str(ckpt), "--out_dir", str(tmp_path / "a_file")], "--out_dir " + str(tmp_path / "a_file")
              + ": " + str(tmp_path / "a_file") + " is a file, not a folder"),
             (["--to", "minimind", "--out_dir", str(tmp_path), "--weight", str(tmp_path / "x.pth")],
              "has no config.json"),
             (["--to", "minimind", "--out_dir", str(tmp_path / "hf"), "--weight", str(tmp_path)], "writes a .pth file")]
    assert convert_main(["--weight", str(ckpt), "--out_dir", str(tmp_path / "hf")]) == 0  # a real folder to import
    capsys.readouterr()
    for argv, expected in cases:
        assert convert_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and "\n" not in err, err


def test_non_finite_logits_fail_the_verification(tmp_path, capsys):
    """NaN logits compare False with any limit: the export must still exit 1, not pass as 'verified'."""
    state = source_model(tiny()).state_dict()
    state["model.norm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "w.pth")
    assert convert_main(["--weight", str(tmp_path / "w.pth"), "--out_dir", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: logits differ by nan")


def test_cli_resolves_typed_paths_against_the_cwd(tmp_path):
    """Run as a program from outside the repository: relative --weight / --out_dir are the cwd's."""
    torch.save(source_model(tiny()).state_dict(), tmp_path / "w.pth")
    proc = forked("scripts/convert_model.py", ["--weight", "w.pth", "--out_dir", "hf_here", "--tokenizer_path",
                                               os.path.join(ROOT, "model")], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "hf_here" / "model.safetensors").is_file()
    missing = forked("scripts/convert_model.py", ["--weight", "nope.pth"], cwd=str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"error: {tmp_path / 'nope.pth'} does not exist; pass a .pth file, a resume checkpoint or a Hugging Face folder"


def test_export_from_the_trainers_own_resume_checkpoint(tmp_path, capsys):
    """A checkpoint written by trainer/train_pretrain.py (top-2 MoE, its own --tokenizer_path) exports faithfully."""
    tok = custom_tokenizer(tmp_path)
    ckpt_dir = tmp_path / "ckpt"
    proc = forked("trainer/train_pretrain.py", [
        *TINY_MODEL, "--use_moe", "1", "--num_experts_per_tok", "2", "--tokenizer_path", str(tok),
        "--data_path", demo_slice(tmp_path, "pretrain", 8), "--max_seq_len", "32", "--batch_size", "4",
        "--accumulation_steps", "1", "--max_steps", "2", "--save_dir", str(tmp_path / "out"),
        "--checkpoint_dir", str(ckpt_dir), "--metrics_file", str(tmp_path / "m.jsonl")], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ckpt = ckpt_dir / "pretrain_64_moe" / "step_2"  # the run's DCP resume directory
    assert convert_main(["--weight", str(ckpt), "--out_dir", str(tmp_path / "hf")]) == 0
    assert "verify: max abs logits diff" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.num_experts_per_tok == 2
    assert (tmp_path / "hf" / "tokenizer_config.json").read_bytes() == (tok / "tokenizer_config.json").read_bytes()
    trained = torch.load(tmp_path / "out" / "pretrain_64_moe.pth")  # the fp32 weights the same run saved
    model = MiniMindForCausalLM(tiny(use_moe=True, num_experts_per_tok=2)).eval()
    model.load_state_dict(trained, strict=True)
    with torch.no_grad():
        assert (model(ids()).logits - hf.float()(ids()).logits).abs().max().item() <= TOL
    # the README's command on the run's .pth, no model flag: top-2 comes from pretrain_64_moe.json beside it
    assert json.loads((tmp_path / "out" / "pretrain_64_moe.json").read_text())["num_experts_per_tok"] == 2
    assert convert_main(["--weight", str(tmp_path / "out" / "pretrain_64_moe.pth"), "--out_dir", str(tmp_path / "hf2"),
                         "--tokenizer_path", str(tok)]) == 0
    hf2 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert hf2.config.num_experts_per_tok == 2
    with torch.no_grad():
        assert (model(ids()).logits - hf2.float()(ids()).logits).abs().max().item() <= TOL


def test_a_wrong_export_exits_non_zero(tmp_path, capsys, monkeypatch):
    """The verification catches issue 9's silent bug: a config read with rope_theta 10000 instead of 1e6."""
    import model.hf_convert as hf_convert
    write_rope = hf_convert.write_rope_both_ways
    monkeypatch.setattr(hf_convert, "write_rope_both_ways", lambda out_dir, rope_theta: write_rope(out_dir, 10000.0))
    torch.save(source_model(tiny()).state_dict(), tmp_path / "w.pth")
    assert convert_main(["--weight", str(tmp_path / "w.pth"), "--out_dir", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bars
    assert err.startswith("error: logits differ by ") and err.endswith("the converted folder is wrong"), err


def test_lora_merges_into_the_pth_and_the_folder(tmp_path, capsys):
    config = tiny()
    torch.save(source_model(config).state_dict(), tmp_path / "full_sft_64.pth")
    adapter = lora_adapter(tmp_path, config)
    assert convert_main(["--weight", str(tmp_path / "full_sft_64.pth"), "--lora", str(adapter),
                         "--out_dir", str(tmp_path / "hf")]) == 0
    assert "wrote " + str(tmp_path / "merge_medical_64.pth") in capsys.readouterr().out  # MiniMind's merged name
    reference = hand_folded(tmp_path / "full_sft_64.pth", adapter, config)
    merged = MiniMindForCausalLM(config).eval()
    merged.load_state_dict(torch.load(tmp_path / "merge_medical_64.pth"))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids()).logits, reference(ids()).logits, rtol=0, atol=TOL)
        assert (reference(ids()).logits - source_model(config)(ids()).logits).abs().max() > 100 * TOL  # it acts
    assert logits_diff(reference, tmp_path / "hf") <= TOL


def test_an_existing_merged_weight_is_refused_unless_overwrite(tmp_path, capsys):
    """--merged_weight at an existing file: one line naming it and --overwrite 1, exit 2, before any work (the file as
    it was, no --out_dir made); --overwrite 1 replaces it with the merge (base + adapter folded by hand)."""
    config = tiny()
    torch.save(source_model(config).state_dict(), tmp_path / "full_sft_64.pth")
    adapter, merged_path, out = lora_adapter(tmp_path, config), tmp_path / "merged.pth", tmp_path / "hf"
    merged_path.write_bytes(b"an earlier merge")
    argv = ["--weight", str(tmp_path / "full_sft_64.pth"), "--lora", str(adapter), "--merged_weight",
            str(merged_path), "--out_dir", str(out)]
    assert convert_main(argv) == 2
    assert capsys.readouterr().err == (f"error: --merged_weight {merged_path} holds an earlier export (merged.pth); "
                                       "--overwrite 1 replaces it, or choose another --merged_weight\n")
    assert merged_path.read_bytes() == b"an earlier merge" and not out.exists()
    assert convert_main(argv + ["--overwrite", "1"]) == 0
    merged = MiniMindForCausalLM(config).eval()
    merged.load_state_dict(torch.load(merged_path))
    with torch.no_grad():
        reference = hand_folded(tmp_path / "full_sft_64.pth", adapter, config)
        torch.testing.assert_close(merged(ids()).logits, reference(ids()).logits, rtol=0, atol=TOL)


def test_lora_for_another_model_is_one_error_line(tmp_path, capsys):
    torch.save(source_model(tiny()).state_dict(), tmp_path / "full_sft_64.pth")
    wide = lora_adapter(tmp_path, tiny(hidden_size=128))
    cases = [(wide, "lora.A.weight has shape [4, 128], the model's adapter [4, 64]"),
             (tmp_path / "full_sft_64.pth", "holds no MiniMind LoRA keys"),
             (tmp_path / "missing.pth", "is not a file")]
    for adapter, expected in cases:
        assert convert_main(["--weight", str(tmp_path / "full_sft_64.pth"), "--lora", str(adapter),
                             "--out_dir", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and "\n" not in err, err


def test_an_export_over_an_earlier_one_replaces_it_whole(tmp_path, capsys):
    """A second export into the same folder: the folder loads as the new model (the source's logits), an earlier
    export's weight shard that this one does not write is gone, a file of the user's stays, no temporary folder."""
    first, second = (source_model(tiny(), seed) for seed in (0, 1))
    out = tmp_path / "hf"
    assert convert_main(["--weight", str(resume_checkpoint(tmp_path / "a.pth", first, ROOT + "/model")),
                         "--out_dir", str(out)]) == 0
    (out / "model-00002-of-00002.safetensors").write_bytes(b"an earlier, sharded export")
    (out / "NOTES.md").write_text("the user's")
    second_export = ["--weight", str(resume_checkpoint(tmp_path / "b.pth", second, ROOT + "/model")), "--out_dir",
                     str(out)]
    capsys.readouterr()
    assert convert_main(second_export) == 2  # as a training run: not replaced unasked
    assert capsys.readouterr().err == (f"error: --out_dir {out} holds an earlier export (config.json); --overwrite 1 "
                                       "replaces it, or choose another --out_dir\n")
    assert logits_diff(first, out) <= TOL
    assert convert_main(second_export + ["--overwrite", "1"]) == 0
    assert logits_diff(second, out) <= TOL and logits_diff(first, out) > 1e-2
    assert not (out / "model-00002-of-00002.safetensors").exists() and (out / "NOTES.md").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["a.pth", "b.pth", "hf"]


@pytest.mark.parametrize("leave", [0, 256 * 1024], ids=["full", "fills_in_the_weights"])
def test_an_export_that_fills_the_disk_is_one_line_and_the_earlier_export_still_loads(tmp_path, capsys, leave,
                                                                                         small_disk):  # noqa: F811
    """The disk is full before the second export (its config.json fails), or fills while the weights are written
    (256 KiB left: safetensors' own error, no OSError): one line (exit 3) naming the folder, and the folder still
    loads as the first export (its logits), with no temporary folder left beside it."""
    first, second = (source_model(tiny(), seed) for seed in (0, 1))
    disk = small_disk(8)
    out = os.path.join(disk, "hf")
    assert convert_main(["--weight", str(resume_checkpoint(tmp_path / "a.pth", first, ROOT + "/model")),
                         "--out_dir", out]) == 0
    fill(disk, leave)
    capsys.readouterr()
    assert convert_main(["--weight", str(resume_checkpoint(tmp_path / "b.pth", second, ROOT + "/model")),
                         "--out_dir", out, "--overwrite", "1"]) == 3
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (  # above it only transformers' "Writing model shards" bar, where it draws one
        f"error: disk full writing {out} (No space left on device); what was there is as it was; free space or "
        "choose another --out_dir, then run again") and "Traceback" not in err
    assert logits_diff(first, out) <= TOL
    assert sorted(os.listdir(disk)) == ["filler", "hf"]


@pytest.mark.parametrize("fields, expected", [(dict(n_shared_experts=1), "qwen3moe has no shared experts"),
                                              (dict(norm_topk_prob=False), "always renormalizes the top-k"),
                                              (dict(inference_rope_scaling=True), "(YaRN) is not written to GGUF")])
def test_gguf_refuses_what_llama_cpp_cannot_hold_in_one_line(tmp_path, capsys, fields, expected):
    model = source_model(tiny(use_moe=True, num_experts_per_tok=2, **fields))
    ckpt = resume_checkpoint(tmp_path / "r.pth", model, os.path.join(ROOT, "model"))
    assert convert_main(["--to", "gguf", "--weight", str(ckpt), "--out_dir", str(tmp_path / "gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err, err
    assert not (tmp_path / "gguf").exists()


def test_gguf_export_merges_lora_and_writes_the_modelfile_beside_it(tmp_path, capsys):
    config = tiny()
    torch.save(source_model(config).state_dict(), tmp_path / "full_sft_64.pth")
    adapter = lora_adapter(tmp_path, config)
    out = tmp_path / "gguf"
    assert convert_main(["--to", "gguf", "--weight", str(tmp_path / "full_sft_64.pth"), "--lora", str(adapter),
                         "--out_dir", str(out), "--gguf_type", "f32"]) == 0
    assert "verify: tensors read back exactly" in capsys.readouterr().out  # f32 (it said "within 0 of their bound")
    state_dict, fields = read_gguf(str(out / "minimind-f32.gguf"))
    assert fields["general.architecture"] == "qwen3" and fields["qwen3.block_count"] == 2
    reference = hand_folded(tmp_path / "full_sft_64.pth", adapter, config)
    for name, value in reference.state_dict().items():
        assert torch.equal(state_dict[name], value), name
    assert (out / "Modelfile").read_text().startswith("FROM ./minimind-f32.gguf\n")
    second = ["--to", "gguf", "--weight", str(tmp_path / "merge_medical_64.pth"), "--out_dir", str(out),
              "--gguf_type", "q8_0"]
    capsys.readouterr()
    # another type is another file: it goes beside the first, and the Modelfile names it (saying what it named)
    assert convert_main(second) == 0
    assert (out / "Modelfile").read_text().startswith("FROM ./minimind-q8_0.gguf\n")
    assert sorted(os.listdir(out)) == ["Modelfile", "minimind-f32.gguf", "minimind-q8_0.gguf"]
    said = capsys.readouterr().out
    assert "the Modelfile named minimind-f32.gguf before; that file stays beside minimind-q8_0.gguf" in said
    assert "verify: tensors read back within " in said and "x their q8_0 rounding bound (<= 1 passes)" in said
    assert convert_main(second) == 2 and "holds an earlier export (minimind-q8_0.gguf); --overwrite 1" in \
        capsys.readouterr().err  # the same type again: as training, not replaced unasked
    assert convert_main(second + ["--overwrite", "1"]) == 0


def serving_names(config):
    """The tensor names vLLM's and SGLang's Qwen3 / Qwen3-MoE load_weights map (q/k/v and gate/up packed by name,
    experts as mlp.experts.<e>.<proj>.weight, lm_head skipped when tied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if config.tie_word_embeddings else
                                                                   {"lm_head.weight"})
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        names |= {f"{p}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        if config.use_moe:
            names |= {f"{p}.mlp.gate.weight"} | {f"{p}.mlp.experts.{e}.{m}.weight" for e in range(config.num_experts)
                                                 for m in ("gate_proj", "up_proj", "down_proj")}
        else:
            names |= {f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    return names


@pytest.mark.parametrize("use_moe", [False, True])
def test_exported_folder_has_what_vllm_and_sglang_qwen3_loaders_read(tmp_path, use_moe):
    """Fields read from config.json by vllm/model_executor/models/qwen3(_moe).py and sglang/srt/models/qwen3(_moe).py,
    as JSON keys, so that a server running transformers 4.x (num_experts, rope_theta) reads them as 5.x does."""
    config = tiny(use_moe=use_moe, num_experts_per_tok=2, rope_theta=5e5, tie_word_embeddings=not use_moe)
    model = source_model(config)
    ckpt = resume_checkpoint(tmp_path / "r.pth", model, os.path.join(ROOT, "model"))
    assert convert_main(["--weight", str(ckpt), "--out_dir", str(tmp_path / "hf")]) == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3MoeForCausalLM" if use_moe else "Qwen3ForCausalLM"]
    assert saved["model_type"] == ("qwen3_moe" if use_moe else "qwen3")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert saved[name] == getattr(config, name), name
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"] == 5e5
    assert saved["rope_parameters"]["rope_type"] == "default" and not saved.get("rope_scaling")
    assert saved["hidden_act"] == "silu" and saved["attention_bias"] is False and not saved["use_sliding_window"]
    if use_moe:
        assert saved["num_experts"] == 4 and saved["num_experts_per_tok"] == 2
        assert saved["moe_intermediate_size"] == config.moe_intermediate_size and saved["norm_topk_prob"] is True
        assert saved["decoder_sparse_step"] == 1 and saved["mlp_only_layers"] == []
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == serving_names(config)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    tokenizer = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    added = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["added_tokens"]
    vocab = {t["content"]: t["id"] for t in added}
    assert generation["eos_token_id"] == vocab[tokenizer["eos_token"]] == vocab["<|im_end|>"]
    assert generation["bos_token_id"] == config.bos_token_id and "chat_template" in tokenizer


def test_a_gguf_export_that_fills_the_disk_is_one_line_and_keeps_the_earlier_one(tmp_path, capsys,
                                                                                 small_disk):  # noqa: F811
    """The disk fills while the GGUF is written (256 KiB left, the file is ~1.2 MiB): one line (exit 3) naming the
    folder; the earlier GGUF and its Modelfile are as they were, no temporary folder is left beside them."""
    first, second = (source_model(tiny(), seed) for seed in (0, 1))
    disk = small_disk(8)
    out = os.path.join(disk, "gguf")
    weight = resume_checkpoint(tmp_path / "a.pth", first, ROOT + "/model")
    assert convert_main(["--to", "gguf", "--weight", str(weight), "--out_dir", out]) == 0
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    fill(disk, 256 * 1024)
    capsys.readouterr()
    weight = resume_checkpoint(tmp_path / "b.pth", second, ROOT + "/model")
    assert convert_main(["--to", "gguf", "--weight", str(weight), "--out_dir", out, "--overwrite", "1"]) == 3
    err = capsys.readouterr().err
    assert err.strip() == (f"error: disk full writing {out} (No space left on device); what was there is as it was; "
                           "free space or choose another --out_dir, then run again")
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before
    assert sorted(os.listdir(disk)) == ["filler", "gguf"]


QA = [("Hi", "Hello there"), ("Bye", "Goodbye now"), ("Thanks", "You are welcome"), ("Sorry", "No problem")]


def test_the_exported_model_answers_a_stock_chat_prompt_without_closing_its_think_block_again(tmp_path, monkeypatch,
                                                                                               capsys):
    """A tiny model SFT-trained from scratch on four one-line chats (seconds, fp32), exported: transformers' own chat
    template (add_generation_prompt=True, tokenize=True) on the folder, then its own generate(), gives each answer's
    first token, not "</think>" (what a row tokenized whole, "</think>", "\\n", "\\n", taught: a stock prompt ends in
    one "\\n\\n" token, which such a model had only seen inside the empty think block)."""
    from transformers import AutoTokenizer

    from tests.helpers.launch import run_in_process, write_rows
    from trainer import train_sft
    data = write_rows(tmp_path / "qa.jsonl", [{"conversations": [{"role": "user", "content": q}, {
        "role": "assistant", "content": a}]} for q, a in QA] * 8)
    out = tmp_path / "out"
    code, err = run_in_process(monkeypatch, capsys, train_sft, [
        *TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", 32, "--batch_size", 4,
        "--packing", 0, "--epochs", 10, "--learning_rate", 5e-3, "--save_dir", out, "--checkpoint_dir", out / "ckpt",
        "--cache_dir", out / "cache", "--log_interval", 100])
    assert code == 0, err
    assert convert_main(["--weight", str(out / "full_sft_64.pth"), "--out_dir", str(tmp_path / "hf")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    for question, answer in QA:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=1,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)  # no token_type_ids (4.56)
        first = tokenizer.convert_ids_to_tokens(out[0, -1].item())
        assert first != "</think>" and first == tokenizer.tokenize(answer)[0], (question, first)
