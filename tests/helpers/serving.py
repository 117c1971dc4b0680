"""The chat server's test helpers: a tiny served model, scripted models, requests over TestClient or real HTTP."""
import json
import threading
import time
from contextlib import contextmanager

import torch
import uvicorn
from transformers.generation import LogitsProcessor, LogitsProcessorList

from model.model_minimind import MiniMindForCausalLM
from tests.helpers.launch import TINY_CONFIG, free_port

CONFIG = TINY_CONFIG  # the served model's shape


PROMPT = "What is a list comprehension?"


def ask(client, **request):
    response = client.post("/v1/chat/completions", json=dict(model="minimind", **request))
    assert response.status_code == 200, response.text
    return response.json()


def ask_stream(client, **request):
    """The streamed chunks (data lines before [DONE])."""
    response = client.post("/v1/chat/completions", json=dict(model="minimind", stream=True, **request))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def joined(chunks, key):
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


class ForceText(LogitsProcessor):
    """Makes generate() produce the given token ids, then EOS: a stand-in for a model trained to call tools."""

    def __init__(self, ids, eos_token_id):
        self.ids, self.eos, self.start = ids, eos_token_id, None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[step] if step < len(self.ids) else self.eos] = 0
        return forced


class ScriptedModel(MiniMindForCausalLM):
    """The real model and generate(), its choice of tokens forced to `script` (a text, or a list of texts, one per
    generate call); it keeps the prompts it was given."""
    script, tokenizer = "", None

    def generate(self, input_ids=None, **kwargs):
        self.prompts.append(self.tokenizer.decode(input_ids[0]))
        script = self.script.pop(0) if isinstance(self.script, list) else self.script
        ids = self.tokenizer(script, add_special_tokens=False).input_ids
        kwargs["logits_processor"] = LogitsProcessorList([ForceText(ids, self.tokenizer.eos_token_id)])
        return super().generate(input_ids=input_ids, **kwargs)


CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>'


@contextmanager
def over_http(app):
    """`app` served by uvicorn on a free local port (a thread of this process): the base URL of its /v1 API."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def greedy_continuation(model, tokenizer, prompt, n):
    """Independent greedy decode without KV cache: argmax over the full forward, token by token."""
    ids = tokenizer(tokenizer.bos_token + prompt, return_tensors="pt", add_special_tokens=False).input_ids
    for _ in range(n):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return tokenizer.decode(ids[0, -n:], skip_special_tokens=True).strip()


def greedy_reply(model, tokenizer, messages, max_new_tokens):
    """transformers' own generate() on the chat template: the reference for eval_llm's output."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([trained_ids(tokenizer, text)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def trained_ids(tokenizer, text):
    """A generation prompt's ids as a stock consumer (transformers' apply_chat_template) tokenizes its text, which is
    what SFT trains on since it cuts its rows where a generation prompt ends (dataset/chat.py)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
