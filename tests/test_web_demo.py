"""scripts/web_demo.py, headless through Streamlit's own AppTest harness: a typed message gets eval_llm's greedy
reply; with a tool offered, a call is answered by the mock tool."""
import os
import socket
import subprocess
import sys

import pytest
import torch
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import load_weights, read_weights, save_weights_file
from scripts.eval_llm import main as eval_main
from scripts.inference import load as inference_load
from tests.helpers.launch import ROOT, free_port
from tests.helpers.serving import CALL, ScriptedModel, greedy_reply

PROMPT = "What is a list comprehension?"
PAGE = os.path.join(ROOT, "scripts", "web_demo.py")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("web") / "full_sft_64.pth")
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            initializer_range=0.1)
    torch.manual_seed(1)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, path)
    return path


@pytest.fixture
def served_scripted(weights):
    model = load_weights(ScriptedModel(MiniMindConfig(**read_weights(weights)[1])), weights).eval()
    model.tokenizer, model.prompts = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")), []
    return model, model.tokenizer


def page(monkeypatch, argv):
    """The page as `streamlit run scripts/web_demo.py -- ARGV` starts it, run once."""
    monkeypatch.setattr(sys, "argv", [PAGE, *argv])
    app = AppTest.from_file(PAGE, default_timeout=120)
    app.run()
    assert not app.exception, app.exception
    return app


def test_typed_message_gets_eval_llms_greedy_reply(weights, monkeypatch, capsys):
    flags = ["--weight", weights, "--device", "cpu", "--temperature", "0", "--max_new_tokens", "16"]
    eval_main([*flags, "--prompt", PROMPT, "--chat", "1"])
    expected = capsys.readouterr().out.split(f">>> {PROMPT}\n", 1)[1][:-1].strip()
    assert expected and not any(tag in expected for tag in ("<think>", "</think>", "<tool_call>"))
    app = page(monkeypatch, flags)
    assert app.sidebar.slider(key="temperature").value == 0.0  # the flag's default reaches the page
    app.chat_input[0].set_value(PROMPT).run()
    assert not app.exception, app.exception
    assert [m.name for m in app.chat_message] == ["user", "assistant"]
    assert app.chat_message[0].markdown[0].value == PROMPT
    assert app.chat_message[1].markdown[0].value == expected
    assert app.session_state["messages"][-1] == {"role": "assistant", "content": expected}


def test_second_message_keeps_the_history(weights, monkeypatch):
    """The second reply is transformers' greedy generate() on the whole conversation through the chat template. The
    weights are found by the default --weight full_sft alone: full_sft_64.pth by its sidecar (issue 39)."""
    flags = ["--save_dir", os.path.dirname(weights), "--device", "cpu", "--temperature", "0", "--max_new_tokens", "12"]
    app = page(monkeypatch, flags)
    app.chat_input[0].set_value("Hello there").run()
    app.chat_input[0].set_value(PROMPT).run()
    assert not app.exception, app.exception
    first, second = (m["content"] for m in app.session_state["messages"][1::2])
    model = load_weights(MiniMindForCausalLM(MiniMindConfig(**read_weights(weights)[1])), weights).eval()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": PROMPT}]
    expected = greedy_reply(model, tokenizer, history, 12).strip()
    assert expected != greedy_reply(model, tokenizer, history[-1:], 12).strip()  # history changes the reply
    assert second == expected


def test_tool_call_is_answered_by_the_mock_tool(served_scripted, monkeypatch):
    """With a tool ticked in the sidebar, the model's call runs the mock tool and the model answers after it (the
    model's tokens forced: a random model does not call tools)."""
    model, tokenizer = served_scripted
    model.script = ["Let me check.\n" + CALL, "Tokyo is 12°C."]
    monkeypatch.setattr(inference_load, "load_chat_model", lambda args: (model, tokenizer))
    app = page(monkeypatch, ["--device", "cpu", "--temperature", "0", "--max_new_tokens", "64", "--seed", "11"])
    app.sidebar.multiselect(key="tools").set_value(["get_current_weather"]).run()
    app.chat_input[0].set_value("Weather in Tokyo?").run()
    assert not app.exception, app.exception
    assert [m.name for m in app.chat_message] == ["user", "assistant", "assistant", "assistant"]
    call, result, answer = app.chat_message[1:]
    assert call.markdown[0].value == "Let me check."
    assert call.code[0].value == 'get_current_weather({"location": "Tokyo"})'
    assert result.code[0].value == '{"city": "Tokyo", "temperature": "12°C", "humidity": "65%", "condition": "晴"}'
    assert answer.markdown[0].value == "Tokyo is 12°C."
    assert '"name": "get_current_weather"' in model.prompts[0]  # the ticked tool reached the template
    assert "<tool_response>\n" + result.code[0].value + "\n</tool_response>" in model.prompts[1]


def test_bad_weights_show_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [PAGE, "--weight", str(tmp_path / "missing.pth"), "--device", "cpu"])
    app = AppTest.from_file(PAGE, default_timeout=60)
    app.run()
    assert [e.value for e in app.error] == [f"error: {tmp_path / 'missing.pth'} does not exist; train it first or "
                                            "pass --weight/--hidden_size/--load_from"]


def test_usage_statistics_are_off(monkeypatch):
    """Streamlit's own config loader, started from the repository root, reads gatherUsageStats false from our
    .streamlit/config.toml; every launch command we document passes the same option by its real name."""
    monkeypatch.chdir(ROOT)
    try:
        st_config.get_config_options(force_reparse=True)
        assert st_config.get_option("browser.gatherUsageStats") is False
    finally:
        monkeypatch.undo()
        st_config.get_config_options(force_reparse=True)
    assert "browser.gatherUsageStats" in st_config._config_options_template
    docs = [open(PAGE).read(), open(os.path.join(ROOT, "docs", "serving.md")).read()]
    commands = [line for text in docs for line in text.splitlines() if "streamlit run" in line]
    assert len(commands) >= 3 and all("streamlit run scripts/web_demo.py --browser.gatherUsageStats false --" in line
                                      for line in commands), commands


def listening_addresses(port):
    """The local addresses of the sockets listening on `port`, from the kernel's tables (Linux)."""
    found = []
    for table, size in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    # the kernel prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, size // 2, 4))
                    found.append(socket.inet_ntop(socket.AF_INET if size == 8 else socket.AF_INET6, words))
    return found


def test_the_chat_listens_on_this_machine_only(weights):
    """`streamlit run scripts/web_demo.py` from the repository root, as the README says: the kernel's listening
    socket is 127.0.0.1's alone (Streamlit's default is every interface, with a Network URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", PAGE, "--server.headless", "true",
                             "--server.port", str(port), "--browser.gatherUsageStats", "false", "--", "--weight",
                             weights, "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        lines = []
        while not any("URL:" in line for line in lines) and proc.poll() is None and len(lines) < 50:
            lines.append(proc.stdout.readline())
        assert listening_addresses(port) == ["127.0.0.1"], lines
        assert not any("Network URL" in line for line in lines), lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_page_warns_when_it_is_open_to_the_network(weights, monkeypatch):
    try:
        st_config.set_option("server.address", "127.0.0.1")
        assert not page(monkeypatch, ["--weight", weights, "--device", "cpu"]).warning  # nothing to say
        st_config.set_option("server.address", "0.0.0.0")
        app = page(monkeypatch, ["--weight", weights, "--device", "cpu"])
    finally:
        st_config.get_config_options(force_reparse=True)
    assert [w.value for w in app.warning] == [
        "This chat listens beyond this machine (server.address 0.0.0.0) and has no access control: anyone who reaches "
        "the port can use the model. `--server.address 127.0.0.1` keeps it local."]
