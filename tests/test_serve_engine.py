"""scripts/serve/engine.py over real HTTP on 127.0.0.1 (uvicorn, httpx, the openai client): clients that leave
mid-stream stop their generation and release the model, a full queue answers 503 with Retry-After, the time limit
cuts a reply, a bounded load leaves the server answering, and SIGTERM ends a long stream and the process."""
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from scripts.serve.app import create_app
from scripts.serve_openai_api import parse_args
from tests.helpers.launch import ROOT, free_port, start_forked
from tests.helpers.serving import CONFIG, PROMPT, over_http, trained_ids

MESSAGES = [{"role": "user", "content": PROMPT}]
LONG = dict(max_tokens=2000, min_tokens=2000)  # a reply that only a stop ends early (EOS held back)


class Watched(MiniMindForCausalLM):
    """The real model, watched: the decode steps of each generate() call (a new one starts at a prompt of several
    tokens), and a gate a forward waits at while the test holds it closed."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids.shape[1] > 1:
            self.steps.append(0)
        else:
            self.steps[-1] += 1
        self.gate.wait()
        return super().forward(input_ids=input_ids, **kwargs)


@pytest.fixture
def watched():
    torch.manual_seed(1)
    model = Watched(MiniMindConfig(**CONFIG, initializer_range=0.1)).eval()
    model.steps, model.gate = [], threading.Event()
    model.gate.set()
    return model, AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


def served(watched, *flags):
    return over_http(create_app(*watched, parse_args(["--device", "cpu", "--temperature", "0", *flags])))


def greedy(model, tokenizer, max_tokens):
    """transformers' greedy generate() on the chat template, without the server; the decode steps it took are not
    counted as a served generation's."""
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, open_thinking=False)
    ids = torch.tensor([trained_ids(tokenizer, text)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.steps.pop()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def post(base_url, **request):
    return httpx.post(f"{base_url}/chat/completions", json={"model": "minimind", "messages": MESSAGES, **request},
                      timeout=120)


def leave_after_first_token(base_url):
    """Stream a long reply, leave once a token has come (the role chunk, then one more event), return the status."""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{base_url}/chat/completions",
                           json=dict(model="minimind", messages=MESSAGES, stream=True, **LONG)) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            next(events), next(events)
            return response.status_code


def test_clients_that_leave_mid_stream_release_the_model(watched):
    """Five streams left after their first token, with oversized requests and two short replies beside them, all at
    once: each left generation stops long before its 2000 tokens, every short reply is the greedy one, and a request
    after the load is answered."""
    model, tokenizer = watched
    want = greedy(model, tokenizer, 8)
    with served(watched, "--max_request_bytes", "2000") as base_url:
        big = [{"role": "user", "content": "x" * 3000}]
        calls = [lambda: leave_after_first_token(base_url)] * 5 + [lambda: post(base_url, messages=big)] * 2
        calls += [lambda: post(base_url, max_tokens=8)] * 2
        with ThreadPoolExecutor(len(calls)) as pool:
            results = [f.result() for f in [pool.submit(call) for call in calls]]
        after = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model="minimind", messages=MESSAGES, max_tokens=8)
    assert results[:5] == [200] * 5 and [r.status_code for r in results[5:7]] == [413, 413]
    assert [r.json()["choices"][0]["message"]["content"] for r in results[7:]] == [want, want]
    assert after.choices[0].message.content == want
    assert len(model.steps) == 8
    assert max(model.steps) < LONG["max_tokens"] - 1, model.steps  # no stream that was left ran to its end


def test_a_full_queue_answers_503_with_retry_after(watched):
    """--max_waiting 1: one generation runs (held at its first forward by the test), one waits, the third request
    is refused with OpenAI's error object and Retry-After; once both leave, the server answers again."""
    model, tokenizer = watched
    want = greedy(model, tokenizer, 6)
    model.gate.clear()
    with served(watched, "--max_waiting", "1") as base_url, httpx.Client(timeout=120) as client:
        request = dict(model="minimind", messages=MESSAGES, stream=True, **LONG)
        with client.stream("POST", f"{base_url}/chat/completions", json=request) as running, \
                client.stream("POST", f"{base_url}/chat/completions", json=request) as waiting:
            assert running.status_code == waiting.status_code == 200
            refused = post(base_url, max_tokens=6)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_error"
            with pytest.raises(openai.InternalServerError, match="queue is full"):
                openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
                    model="minimind", messages=MESSAGES, max_tokens=6)
        model.gate.set()
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=5)  # retries honour Retry-After
        reply = api.chat.completions.create(model="minimind", messages=MESSAGES, max_tokens=6)
    assert reply.choices[0].message.content == want
    assert len(model.steps) == 2 and model.steps[0] < LONG["max_tokens"] - 1  # the waiting one never started


def test_the_time_limit_ends_a_reply_with_length(watched):
    """--request_timeout shorter than one token: the first choice gets its first token (the limit is checked after
    each), the second none; both end "length"."""
    model, tokenizer = watched
    first = greedy(model, tokenizer, 1)
    with served(watched, "--request_timeout", "1e-9") as base_url:
        reply = post(base_url, n=2, max_tokens=5, min_tokens=5).json()
    assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
    assert [c["message"]["content"] for c in reply["choices"]] == [first, ""]
    assert reply["usage"]["completion_tokens"] == 1


def serving_script(tmp_path, config):
    """The real scripts/serve_openai_api.py in its own process over a saved model of `config`, once it answers
    /v1/models (up to a minute for the model to load): (process, port, its log's path). The caller kills it."""
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    port, log = free_port(), tmp_path / "server.log"
    server = start_forked("scripts/serve_openai_api.py", ["--save_dir", tmp_path, "--port", port, "--device", "cpu"],
                          log_path=str(log))
    try:
        for _ in range(600):
            assert server.poll() is None, log.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                return server, port, log
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"the server did not answer within a minute:\n{log.read_text()}")
    except BaseException:
        server.kill()
        raise


def test_sigterm_ends_a_long_stream_and_the_server(tmp_path):
    """The real script in its own process: SIGTERM during a 30000-token stream ends the stream (finish_reason
    length, far fewer tokens) and the process, by the signal (143 in a shell), with one signal."""
    server, port, log = serving_script(tmp_path, MiniMindConfig(**CONFIG, initializer_range=0.1))
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        request = dict(model="minimind", messages=MESSAGES, stream=True, max_tokens=30000, min_tokens=30000,
                       stream_options={"include_usage": True})
        with httpx.stream("POST", f"{base_url}/chat/completions", json=request, timeout=120) as response:
            lines = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            received = [next(lines), next(lines)]
            server.send_signal(signal.SIGTERM)
            received += list(lines)
        assert server.wait(timeout=60) == -signal.SIGTERM, log.read_text()
    finally:
        server.kill()
    assert received[-1] == "[DONE]"
    chunks = [json.loads(line) for line in received[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] < 30000


def test_two_ctrl_cs_stop_the_server_with_exit_130_and_no_traceback(tmp_path):
    """The real script in its own process: Ctrl-C twice (the second forces uvicorn's exit) ends it with 130, the
    SIGINT exit docs/serving.md gives, and nothing on its output but uvicorn's own lines (it printed two tracebacks:
    the lifespan task cancelled, then asyncio's KeyboardInterrupt)."""
    server, port, log = serving_script(tmp_path, MiniMindConfig(**CONFIG))
    try:
        server.send_signal(signal.SIGINT)
        time.sleep(0.05)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 130, log.read_text()
    finally:
        server.kill()
    text = log.read_text()
    assert "Traceback" not in text and "Error" not in text and "INFO:     Finished server process" in text, text
