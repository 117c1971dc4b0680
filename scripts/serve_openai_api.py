"""An OpenAI-compatible chat server over the project's model: FastAPI + uvicorn, MiniMind's flags.

    python scripts/serve_openai_api.py --weight full_sft --port 8998
    python scripts/serve_openai_api.py --load_from out/hf_model --open_thinking 1 --host 0.0.0.0
    curl http://127.0.0.1:8998/v1/chat/completions -H "Content-Type: application/json" \\
         -d '{"model": "minimind", "messages": [{"role": "user", "content": "Hello"}]}'

POST /v1/chat/completions (stream or not): the request's messages and `tools` go through the chat template; the
reply's think block comes back as `reasoning_content`, its <tool_call> blocks as `tool_calls` (finish_reason
"tool_calls"), with `usage` (prompt, completion, total tokens; a stream sends it when stream_options.include_usage).
Per request: temperature (0 greedy), top_p, max_tokens, seed, and the thinking switch (`open_thinking`, or
chat_template_kwargs.open_thinking / enable_thinking; --open_thinking is the default). GET /v1/models lists the model.
One generation at a time (a lock): the model is one copy on one device.
"""
import argparse
import itertools
import json
import math
import os
import sys
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from dataset.tools import parse_assistant  # noqa: E402
from scripts.eval_llm import (  # noqa: E402
    add_model_args,
    add_sampling_args,
    generate_ids,
    load_or_exit,
    parsed,
    render_prompt,
    stream_ids,
)

ROLES = ("system", "user", "assistant", "tool")  # what the chat template renders


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request this server reads (others are accepted and ignored)."""
    model: str | None = None
    messages: list[dict]
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    tools: list[dict] | None = None
    open_thinking: bool | None = None
    chat_template_kwargs: dict | None = None


class RequestError(ValueError):
    """A request value out of range: a 400 naming the field."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


def error_response(message, param=None, status=400):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error",
                                                               "param": param, "code": None}})


def settings(request, args):
    """(temperature, top_p, max_tokens, open_thinking) of a request, the flags filling in what it leaves out."""
    temperature = args.temperature if request.temperature is None else request.temperature
    top_p = args.top_p if request.top_p is None else request.top_p
    given = [n for n in (request.max_completion_tokens, request.max_tokens) if n is not None]
    max_tokens = given[0] if given else args.max_new_tokens
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"temperature must be a finite number, 0 (greedy) or more (got {temperature})",
                           "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1] (got {top_p})", "top_p")
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1 (got {max_tokens})", "max_tokens")
    if request.seed is not None and not 0 <= request.seed < 2 ** 32:
        raise RequestError(f"seed must be in [0, 2**32) (got {request.seed})", "seed")
    if not request.messages:
        raise RequestError("messages must hold at least one message", "messages")
    for i, message in enumerate(request.messages):
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {message.get('role')!r})",
                               "messages")
    kwargs = request.chat_template_kwargs or {}
    thinking = request.open_thinking
    if thinking is None:
        thinking = kwargs.get("open_thinking", kwargs.get("enable_thinking", bool(args.open_thinking)))
    return temperature, top_p, max_tokens, bool(thinking)


def seeded(seed):
    """A request's seed makes its sampling repeatable (taken under the generation lock)."""
    if seed is not None:
        torch.manual_seed(seed)


def finish_reason(turn, new_ids, max_tokens, eos_token_id):
    """tool_calls when the reply calls a tool, length when max_tokens cut it, else stop."""
    if turn.tool_calls:
        return "tool_calls"
    ended = len(new_ids) > 0 and int(new_ids[-1]) == eos_token_id
    return "length" if len(new_ids) >= max_tokens and not ended else "stop"


def text_content(message):
    """A message whose content is OpenAI's list of parts, as the text of its text parts (the template reads strings)."""
    if isinstance(message.get("content"), list):
        return dict(message, content="".join(part.get("text", "") for part in message["content"]
                                             if isinstance(part, dict) and part.get("type") == "text"))
    return message


def with_unique_ids(calls):
    """The parsed calls with ids unique across the conversation (the client answers each by its id)."""
    return [dict(call, id=f"call_{uuid.uuid4().hex[:24]}") for call in calls]


def create_app(model, tokenizer, args):
    """The FastAPI app serving `model` (a causal LM in eval mode) with `tokenizer`'s chat template; `args` holds the
    request defaults (temperature, top_p, max_new_tokens, open_thinking) and served_model_name."""
    app, lock, created = FastAPI(title="MiniMind-4D"), threading.Lock(), int(time.time())
    name = args.served_model_name

    def prompt_of(request, thinking):
        try:
            return render_prompt(tokenizer, [text_content(m) for m in request.messages], chat=True,
                                 open_thinking=thinking, tools=request.tools)
        except Exception as e:  # the template's own message (a missing role, a bad tool schema)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from e

    def usage(prompt_tokens, completion_tokens):
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "minimind"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest):
        try:
            temperature, top_p, max_tokens, thinking = settings(request, args)
            text = prompt_of(request, thinking)
        except RequestError as e:
            return error_response(str(e), e.param)
        reply_id, started = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sampling = (max_tokens, temperature, top_p)
        if request.stream:
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            chunks = stream_chunks(text, sampling, thinking, request.seed, reply_id, started, include_usage)
            lines = (f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
            return StreamingResponse(itertools.chain(lines, ["data: [DONE]\n\n"]), media_type="text/event-stream")
        with lock:
            seeded(request.seed)
            prompt_ids, new_ids = generate_ids(model, tokenizer, text, *sampling)
        turn = parse_assistant(tokenizer.decode(new_ids, skip_special_tokens=True), thinking)
        turn.tool_calls = with_unique_ids(turn.tool_calls)
        message = turn.message()
        return {"id": reply_id, "object": "chat.completion", "created": started, "model": name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason(turn, new_ids, max_tokens, tokenizer.eos_token_id)}],
                "usage": usage(len(prompt_ids), len(new_ids))}

    def stream_chunks(text, sampling, thinking, seed, reply_id, started, include_usage):
        """The chunk objects of a streamed reply: role, then reasoning/content deltas that only grow (the partial
        parse), the tool calls once whole, the finish reason, usage if asked."""
        def chunk(delta, finish=None):
            return {"id": reply_id, "object": "chat.completion.chunk", "created": started, "model": name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        sent = {"reasoning_content": "", "content": ""}

        def deltas(turn):
            for key in sent:
                value = getattr(turn, key) or ""
                if len(value) > len(sent[key]):
                    yield chunk({key: value[len(sent[key]):]})
                    sent[key] = value

        new_ids = []
        with lock:
            seeded(seed)
            prompt_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
            for token in stream_ids(model, tokenizer, text, *sampling):
                new_ids.append(token)
                yield from deltas(parse_assistant(tokenizer.decode(new_ids, skip_special_tokens=True), thinking,
                                                  final=False))
        turn = parse_assistant(tokenizer.decode(new_ids, skip_special_tokens=True), thinking)
        yield from deltas(turn)
        if turn.tool_calls:
            calls = [dict(call, index=i) for i, call in enumerate(with_unique_ids(turn.tool_calls))]
            yield chunk({"tool_calls": calls})
        yield chunk({}, finish_reason(turn, new_ids, sampling[0], tokenizer.eos_token_id))
        if include_usage:
            yield dict(chunk({}), choices=[], usage=usage(prompt_tokens, len(new_ids)))

    return app


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="OpenAI-compatible server for MiniMind models")
    add_model_args(parser, weight="full_sft")
    add_sampling_args(parser, max_new_tokens=1024, temperature=0.85)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines too")
    parser.add_argument("--port", type=int, default=8998)
    parser.add_argument("--served_model_name", default="minimind", help="the model id /v1/models lists")
    return parsed(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load_or_exit(args)
    torch.manual_seed(args.seed)
    uvicorn.run(create_app(model, tokenizer, args), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
