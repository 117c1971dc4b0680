"""scripts/serve/requests.py through the server: content as OpenAI's schema allows, n and stop honoured or refused,
max_tokens within the model's context, the prompt and body limits, OpenAI's error object for every 4xx, --api_key,
and a bad --port as one line."""
import os
import socket

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from scripts.serve.app import create_app
from scripts.serve_openai_api import main, parse_args
from tests.helpers.launch import ROOT
from tests.helpers.serving import CONFIG, ask, ask_stream, joined, over_http, trained_ids

CONTEXT = 64  # a model of 64 positions: a request can reach its end in a few tokens


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(2)
    model = MiniMindForCausalLM(MiniMindConfig(**CONFIG, max_position_embeddings=CONTEXT, initializer_range=0.1))
    return model.eval(), AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


def client_of(small, *flags):
    args = parse_args(["--device", "cpu", "--temperature", "0", "--max_new_tokens", "1000", *flags])
    return TestClient(create_app(*small, args))


def prompt_tokens(tokenizer, content):
    """The prompt's length as the chat template renders it (written out here, not asked of the server)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, open_thinking=False)
    return len(trained_ids(tokenizer, text))


def refused(response, status, param, message):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert message in error["message"], error["message"]
    return error


@pytest.mark.parametrize("content,got", [(42, "int"), ({"text": "hi"}, "dict"), (None, "null"),
                                         ([{"type": "image_url", "image_url": {"url": "x"}}], "list"), ([], "list")])
def test_content_other_than_text_is_a_400(small, content, got):
    response = client_of(small).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    refused(response, 400, "messages", 'messages[0].content must be a string or a list of text parts ({"type": '
            f'"text", "text": ...}}); got {got}')


@pytest.mark.parametrize("field,value,message", [
    ("n", 0, "n must be in 1..8 (got 0)"), ("n", 9, "n must be in 1..8 (got 9)"),
    ("stop", ["a", "b", "c", "d", "e"], "stop must be a string or a list of up to 4 non-empty strings"),
    ("stop", [""], "stop must be a string or a list of up to 4 non-empty strings"),
    ("temperature", "hot", "temperature: "),  # the rest is pydantic's wording
    ("messages", "hi", "messages: "),
    ("min_tokens", 5, "min_tokens must be at most max_tokens (4)"),
])
def test_bad_field_is_a_400_naming_it(small, field, value, message):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    refused(client_of(small).post("/v1/chat/completions", json=request), 400, field, message)


def test_what_fastapi_refuses_is_openais_error_object(small):
    client = client_of(small)
    refused(client.post("/v1/chat/completions", content=b"{not json"), 400, None,
            "the request body is not valid JSON")
    refused(client.post("/v1/chat/completions", json=[1]), 400, None, "the request body: ")
    refused(client.get("/v1/nowhere"), 404, None, "Not Found")
    refused(client.get("/v1/chat/completions"), 405, None, "Method Not Allowed")


def test_stop_cuts_the_reply_before_the_stop_string(small):
    client = client_of(small)
    request = dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24)
    full = ask(client, **request)["choices"][0]["message"]["content"]
    words = full.split()
    assert len(words) > 3, full
    stop = words[len(words) // 2]
    want = full[:full.index(stop)].strip()  # the greedy reply is the same up to the stop string
    for stops in (stop, ["never there", stop]):
        choice = ask(client, stop=stops, **request)["choices"][0]
        assert choice["message"]["content"] == want and choice["finish_reason"] == "stop"
        chunks = ask_stream(client, stop=stops, **request)
        assert joined(chunks, "content") == want and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_past_the_context_is_a_400_and_the_default_fits(small):
    tokenizer, client = small[1], client_of(small)
    room = CONTEXT - prompt_tokens(tokenizer, "hi")
    messages = [{"role": "user", "content": "hi"}]
    refused(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": room + 1}), 400,
            "max_tokens", f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
            f"{CONTEXT + 1} tokens ({CONTEXT - room} in the messages, {room + 1} in the completion).")
    refused(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10 ** 9}), 400,
            "max_tokens", "maximum context length")
    for request in ({"max_tokens": room}, {}):  # {}: the flag's 1000, cut to the room the context leaves
        reply = ask(client, messages=messages, min_tokens=room, **request)
        assert reply["usage"]["completion_tokens"] == room and reply["choices"][0]["finish_reason"] == "length"


def test_prompt_and_body_limits(small):
    tokenizer, client = small[1], client_of(small, "--max_prompt_tokens", "40", "--max_request_bytes", "3000")
    long = "word " * 60
    refused(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}), 400,
            "messages", f"the prompt is {prompt_tokens(tokenizer, long)} tokens; this server takes at most 40 "
            "(--max_prompt_tokens)")
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 3000 + b'"}]}'
    refused(client.post("/v1/chat/completions", content=body), 413, None,
            f"the request body is {len(body)} bytes; this server takes at most 3000 (--max_request_bytes)")
    chunks = (body[i:i + 500] for i in range(0, len(body), 500))  # no Content-Length: counted as it comes
    refused(client.post("/v1/chat/completions", content=chunks), 413, None, "the request body is over 3000 bytes")


def test_api_key_is_asked_when_set(small):
    messages = [{"role": "user", "content": "hi"}]
    with over_http(create_app(*small, parse_args(["--device", "cpu", "--api_key", "s3cret"]))) as base_url:
        with pytest.raises(openai.AuthenticationError, match="a valid API key is needed"):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        api = openai.OpenAI(base_url=base_url, api_key="s3cret", max_retries=0)
        assert api.chat.completions.create(model="minimind", messages=messages, max_tokens=2).choices
        error = refused(httpx.post(f"{base_url}/chat/completions", json={"messages": messages}), 401, None,
                        "a valid API key is needed")
        assert error["code"] == "invalid_api_key"


def test_bad_port_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--port", "99999", "--device", "cpu"])
    assert caught.value.code == 2 and capsys.readouterr().err == "error: --port must be in 1..65535 (got 99999)\n"
    config = MiniMindConfig(**CONFIG)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as caught:
            main(["--save_dir", str(tmp_path), "--port", str(port), "--device", "cpu"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: cannot listen on 127.0.0.1:{port} (Address already "
                                                         "in use); pass another --port or --host")
