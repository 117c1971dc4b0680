"""scripts/serve_openai_api.py says where it listens: one line with the URL, the API paths and whether a key is
needed (uvicorn, handed a bound socket, prints no address)."""
import signal
import socket
import time

import httpx

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from scripts.serve_openai_api import address_line, parse_args
from tests.helpers.launch import free_port, start_forked
from tests.helpers.serving import CONFIG


def test_the_line_without_a_key_and_on_ipv6():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        line = address_line(parse_args(["--port", str(port)]), sock)
        ipv6 = address_line(parse_args(["--host", "::1"]), sock)  # the host as typed, in brackets
    url = f"http://127.0.0.1:{port}/v1"
    assert line == (f"serving minimind at {url} (POST {url}/chat/completions, GET {url}/models); API key not "
                    "required (--api_key sets one)")
    assert f"at http://[::1]:{port}/v1 (" in ipv6


def test_the_server_prints_the_address_it_answers_at(tmp_path):
    """The real script: the line's URL is where it answers, and the key it says is required is (401 without)."""
    config = MiniMindConfig(**CONFIG)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    port, log = free_port(), tmp_path / "server.log"
    server = start_forked("scripts/serve_openai_api.py", ["--save_dir", tmp_path, "--port", port, "--device", "cpu",
                                                          "--api_key", "SECRET"], log_path=str(log))
    try:
        deadline = time.time() + 120  # the model loads first
        while not (log.exists() and "serving " in log.read_text()) and time.time() < deadline:
            assert server.poll() is None, log.read_text()
            time.sleep(0.1)
        (line,) = [text for text in log.read_text().splitlines() if text.startswith("serving ")]
        url = f"http://127.0.0.1:{port}/v1"
        assert line == (f"serving minimind at {url} (POST {url}/chat/completions, GET {url}/models); API key "
                        "required: send Authorization: Bearer <its --api_key>")
        for _ in range(100):  # uvicorn starts serving the socket just after the line
            try:
                refused = httpx.get(f"{url}/models", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert refused.status_code == 401
        models = httpx.get(f"{url}/models", headers={"Authorization": "Bearer SECRET"}, timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["minimind"]
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    finally:
        server.kill()
