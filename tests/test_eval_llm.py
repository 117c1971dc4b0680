"""scripts/eval_llm.py generates from weights and HF folders: its greedy output equals transformers' generate()."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.errors import ConfigError
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from model.weights.shapes import WeightsError
from scripts.convert_model import main as convert_main
from scripts.eval_llm import main as eval_main
from scripts.eval_llm import parse_args
from scripts.inference.generate import render_prompt
from scripts.inference.load import check_args, load_model
from tests.helpers.launch import ROOT, forked
from tests.helpers.serving import greedy_continuation, greedy_reply
from tests.helpers.weight_files import hand_folded, lora_adapter


def test_eval_llm_streams_the_greedy_continuation(tmp_path):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config).eval()
    torch.save(model.state_dict(), tmp_path / "pretrain_64.pth")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    prompt = "The Python interpreter"
    ids = tokenizer(tokenizer.bos_token + prompt, return_tensors="pt", add_special_tokens=False).input_ids
    # independent greedy decode without KV cache: argmax over the full forward, token by token
    for _ in range(12):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    expected = tokenizer.decode(ids[0, -12:], skip_special_tokens=True)
    proc = forked("scripts/eval_llm.py", ["--save_dir", str(tmp_path), "--weight", "pretrain", "--hidden_size", "64",
                                          "--num_hidden_layers", "2", "--num_attention_heads", "4",
                                          "--num_key_value_heads", "2", "--prompt", prompt, "--temperature", "0",
                                          "--max_new_tokens", "12", "--device", "cpu"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expected.strip() and expected.strip() in proc.stdout, (expected, proc.stdout)


def test_trainers_moe_weights_need_no_model_flag(tmp_path):
    """A top-2 MoE .pth as the trainer writes it (with pretrain_64_moe.json beside it) generates as top-2 with only
    --weight: eval_llm's defaults (hidden 768, dense, top-1) give way to the saved config."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts=4, num_experts_per_tok=2, initializer_range=0.1)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config).eval()
    save_weights_file(model.state_dict(), config, str(tmp_path / "pretrain_64_moe.pth"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    prompt = "The Python interpreter"
    expected = greedy_continuation(model, tokenizer, prompt, 12)
    model.config.num_experts_per_tok = 1  # what the flags' default would have run
    assert expected and greedy_continuation(model, tokenizer, prompt, 12) != expected
    proc = forked("scripts/eval_llm.py", ["--weight", str(tmp_path / "pretrain_64_moe.pth"), "--prompt", prompt,
                                          "--chat", "0", "--temperature", "0", "--max_new_tokens", "12",
                                          "--device", "cpu"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expected in proc.stdout, (expected, proc.stdout)


def exported_folder(tmp_path, fmt):
    """A tiny model exported by convert_model.py (Qwen3-MoE top-2, or MiniMind's own format)."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            use_moe=True, num_experts_per_tok=2, initializer_range=0.1)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config)
    torch.save(dict(model=model.state_dict(), config=config.to_dict(),
                    args=dict(tokenizer_path=os.path.join(ROOT, "model"))), tmp_path / "sft_resume.pth")
    assert convert_main(["--weight", str(tmp_path / "sft_resume.pth"), "--out_dir", str(tmp_path / fmt),
                         "--format", fmt]) == 0
    return tmp_path / fmt


@pytest.mark.parametrize("fmt", ["qwen3", "minimind"])
def test_load_from_folder_equals_transformers_generate(tmp_path, fmt):
    folder = exported_folder(tmp_path, fmt)
    reference = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = greedy_reply(reference, tokenizer, [{"role": "user", "content": "What is a list?"}], 12)
    proc = forked("scripts/eval_llm.py", ["--load_from", str(folder), "--prompt", "What is a list?", "--temperature",
                                          "0", "--max_new_tokens", "12", "--device", "cpu"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expected.strip() and expected.strip() in proc.stdout, (expected, proc.stdout)


def test_interactive_mode_keeps_the_history(tmp_path):
    folder = exported_folder(tmp_path, "qwen3")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    turns = ["Hello there", "And then?"]
    first = greedy_reply(reference, tokenizer, [{"role": "user", "content": turns[0]}], 10)
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first},
               {"role": "user", "content": turns[1]}]
    second = greedy_reply(reference, tokenizer, history, 10)
    alone = greedy_reply(reference, tokenizer, [{"role": "user", "content": turns[1]}], 10)
    assert second != alone  # otherwise this test could not tell history from no history
    proc = forked("scripts/eval_llm.py", ["--load_from", "qwen3", "--interactive", "1", "--temperature", "0",
                                          "--max_new_tokens", "10", "--device", "cpu"],
                  input="\n".join(turns) + "\n", timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.index(first.strip()) < out.index(">>> And then?") < out.index(second.strip()), (first, second, out)


def test_open_thinking_reaches_the_chat_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, messages, chat=True, open_thinking=1) == "<user>hi<think>"
    assert render_prompt(tokenizer, messages, chat=True, open_thinking=0) == "<user>hi<think></think>"
    assert render_prompt(tokenizer, messages, chat=False, open_thinking=1) == tokenizer.bos_token + "hi"
    ours = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))  # MiniMind-3's switch is open_thinking
    header = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(ours, messages, chat=True, open_thinking=1) == header + "<think>\n"
    assert render_prompt(ours, messages, chat=True, open_thinking=0) == header + "<think>\n\n</think>\n\n"


def test_bad_folder_is_one_error_line(tmp_path):
    proc = forked("scripts/eval_llm.py", ["--load_from", str(tmp_path), "--prompt", "x", "--device", "cpu"],
                  timeout=180)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: --load_from {tmp_path} has no config.json; it takes a Hugging Face model "
                                   "folder")


@pytest.mark.parametrize("argv,message", [
    (["--max_new_tokens", "0"], "--max_new_tokens must be at least 1 (got 0)"),
    (["--temperature", "-1"], "--temperature must be a finite number, 0 (greedy) or more (got -1.0)"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--top_p", "0"], "--top_p must be in (0, 1] (got 0.0)"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1] (got 1.5)"),
    (["--seed", "-1"], "--seed must be in [0, 2**32) (got -1)"),
    (["--num_key_value_heads", "0"], "--num_key_value_heads must be at least 1 (got 0)"),
    (["--device", "tpu"], "--device tpu is not a device this trainer runs on"),
    (["--tokenizer_path", "/nonexistent"], "--tokenizer_path /nonexistent is not a directory"),
])
def test_bad_flag_is_rejected_before_loading(argv, message):
    """Each wrong value is one ConfigError naming the flag (main prints it as `error: ...` and exits 2)."""
    with pytest.raises(ConfigError) as caught:
        check_args(parse_args(["--device", "cpu", *argv]))
    assert message in str(caught.value)


def test_folder_without_tokenizer_names_load_from(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no tokenizer; pass --tokenizer_path"):
        check_args(parse_args(["--load_from", str(tmp_path), "--device", "cpu"]))


def test_bad_sampling_value_exits_2_with_one_line(tmp_path):
    torch.save(MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2)).state_dict(), tmp_path / "w.pth")
    proc = forked("scripts/eval_llm.py", ["--weight", str(tmp_path / "w.pth"), "--hidden_size", "64", "--top_p", "2",
                                          "--device", "cpu"], timeout=180)
    assert proc.returncode == 2  # stdout: trainer/base/prelude.py's line only
    assert proc.stdout == "scripts/eval_llm.py: loading torch, transformers and the model ...\n"
    assert proc.stderr.strip() == "error: --top_p must be in (0, 1] (got 2.0); 1 keeps every token"


def test_lora_chats_with_base_plus_adapter(tmp_path, capsys):
    """--lora NAME finds out/lora/<NAME>_<hidden>.pth; the greedy reply is a hand-folded model's (W + B @ A)."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    base = MiniMindForCausalLM(config).eval()
    save_weights_file(base.state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    (tmp_path / "lora").mkdir()
    adapter = lora_adapter(tmp_path / "lora", config)
    reference = hand_folded(tmp_path / "full_sft_64.pth", adapter, config)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    prompt = "The Python interpreter"
    expected = greedy_continuation(reference, tokenizer, prompt, 12)
    assert expected != greedy_continuation(base, tokenizer, prompt, 12)  # the adapter changes the reply
    eval_main(["--save_dir", str(tmp_path), "--weight", "full_sft", "--hidden_size", "64", "--lora", "lora_medical",
               "--prompt", prompt, "--chat", "0", "--temperature", "0", "--max_new_tokens", "12", "--device", "cpu"])
    assert expected and expected in capsys.readouterr().out


def test_lora_for_another_shape_exits_2_with_one_line(tmp_path, capsys):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, str(tmp_path / "w.pth"))
    wide = lora_adapter(tmp_path, MiniMindConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2))
    with pytest.raises(SystemExit) as caught:
        eval_main(["--weight", str(tmp_path / "w.pth"), "--lora", str(wide), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith("error: ") and "\n" not in err
    assert "lora.A.weight has shape [4, 128], the model's adapter [4, 64]" in err


def test_a_reply_starts_with_its_first_word_not_blank_lines(capsys):
    """A small model's reply often opens with newlines (the issue saw about four blank lines): the streamed reply
    drops the leading whitespace, and only that, as the model's tokens arrive one by one."""
    from scripts.inference.generate import ReplyStreamer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    ids = tokenizer("\n\n\n\n Hello there,\n\n  friend.", add_special_tokens=False).input_ids
    streamer = ReplyStreamer(tokenizer, skip_special_tokens=True)
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert len(ids) > 3 and capsys.readouterr().out == "Hello there,\n\n  friend.\n"


def test_a_weight_prefix_alone_loads_the_runs_size(tmp_path):
    """After the README's small chain (out/full_sft_256.pth and its sidecar) `--weight full_sft` needs no size flag:
    the one file of that prefix is loaded with its sidecar's shape (here 64, two layers), the same weights."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    saved = MiniMindForCausalLM(config).eval()
    save_weights_file(saved.state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    save_weights_file(saved.state_dict(), config, str(tmp_path / "pretrain_96.pth"))  # another prefix: not a choice
    model, path = load_model(parse_args(["--save_dir", str(tmp_path), "--weight", "full_sft", "--device", "cpu"]))
    assert path == str(tmp_path / "full_sft_64.pth")
    ids = torch.arange(1, 9).view(1, 8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, saved(ids).logits)


def test_a_weight_prefix_of_several_sizes_names_the_files(tmp_path):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    wide = MiniMindConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    for shape in (config, wide):
        path = str(tmp_path / f"full_sft_{shape.hidden_size}.pth")
        save_weights_file(MiniMindForCausalLM(shape).state_dict(), shape, path)
    args = ["--save_dir", str(tmp_path), "--weight", "full_sft", "--device", "cpu"]
    with pytest.raises(WeightsError) as caught:
        load_model(parse_args(args))
    assert str(caught.value) == (f"{tmp_path}/full_sft_<hidden_size>.pth names 2 files; {tmp_path} has "
                                 "full_sft_128.pth (--hidden_size 128), full_sft_64.pth (--hidden_size 64): pass its "
                                 f"size flags or --weight {tmp_path}/full_sft_128.pth; or pass --hidden_size")
    with pytest.raises(WeightsError) as caught:
        load_model(parse_args([*args, "--hidden_size", "768"]))
    assert str(caught.value).startswith(f"{tmp_path}/full_sft_768.pth does not exist; {tmp_path} has full_sft_128.pth")
    assert load_model(parse_args([*args, "--hidden_size", "128"]))[0].config.hidden_size == 128
