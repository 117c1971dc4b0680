"""An OpenAI-compatible chat server over the project's model: FastAPI + uvicorn, MiniMind's flags.

    python scripts/serve_openai_api.py --weight full_sft --port 8998
    python scripts/serve_openai_api.py --load_from out/hf_model --open_thinking 1 --host 0.0.0.0 --api_key SECRET
    curl http://127.0.0.1:8998/v1/chat/completions -H "Content-Type: application/json" \\
         -d '{"model": "minimind", "messages": [{"role": "user", "content": "Hello"}]}'

POST /v1/chat/completions (stream or not): the request's messages and `tools` go through the chat template; the
reply's think block comes back as `reasoning_content`, its <tool_call> blocks as `tool_calls` (finish_reason
"tool_calls"), with `usage` (prompt, completion, total tokens; a stream sends it when stream_options.include_usage).
Per request: temperature (0 greedy), top_p, max_tokens, n, stop, seed, min_tokens (vLLM's) and the thinking switch
(`open_thinking`, or chat_template_kwargs.open_thinking / enable_thinking). GET /v1/models lists the model.
One generation at a time (scripts/serve_engine.py); --max_waiting more wait, others get 503 with Retry-After. Limits:
--max_request_bytes (413), --max_prompt_tokens and the model's context (400), --request_timeout. Every refusal is
OpenAI's error object. docs/serving.md has the whole story.
"""
import argparse
import asyncio
import hmac
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.runtime.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers, FastAPI and the model")

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import Depends, FastAPI, Header, HTTPException, Request  # noqa: E402
from fastapi.concurrency import run_in_threadpool  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

from scripts.eval_llm import add_model_args, add_sampling_args, load_or_exit, parsed, render_prompt  # noqa: E402
from scripts.serve_engine import Engine, Full, Generation  # noqa: E402
from scripts.serve_replies import Reply, batches, event_lines  # noqa: E402
from scripts.serve_requests import (  # noqa: E402
    RequestError,
    error_response,
    fit_max_tokens,
    parse_request,
    read_body,
    settings,
    text_content,
)

loaded()  # the imports are done: the script's own Ctrl-C handling from here


class JobStream(StreamingResponse):
    """A streamed reply that cancels its job however the response ends: done, failed, or cancelled by Starlette when
    the client goes away (ASGI 2.3 servers cancel the response and never close its body's generator)."""

    def __init__(self, job, body):
        super().__init__(body, media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def cancel_when_gone(request, job):
    """Cancel `job` when the client of a non-streamed request disconnects (vLLM's with_cancellation)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def whole_reply(job, reply, request):
    watcher = asyncio.ensure_future(cancel_when_gone(request, job))
    try:
        async for batch in batches(job):
            for kind, index, token in batch:
                if kind == "token":
                    reply.ids[index].append(token)
    finally:
        watcher.cancel()
        job.cancel()
    return reply.whole()


def add_error_handlers(app):
    """OpenAI's error object for what FastAPI and Starlette refuse themselves (a 404, a 405, a 422 made a 400)."""
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        code = "invalid_api_key" if exc.status_code == 401 else None
        return error_response(str(exc.detail), status=exc.status_code, code=code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        first = exc.errors()[0]
        return error_response(f"{'.'.join(map(str, first['loc']))}: {first['msg']}")


def key_check(api_key):
    """A dependency that refuses (401) a request without `Authorization: Bearer <api_key>`; none when api_key is
    None."""
    async def authorized(authorization: str | None = Header(default=None)):
        if api_key is not None and not hmac.compare_digest((authorization or "").encode(),
                                                           f"Bearer {api_key}".encode()):
            raise HTTPException(401, "a valid API key is needed: send Authorization: Bearer <the server's --api_key>",
                                headers={"WWW-Authenticate": "Bearer"})
    return authorized


def create_app(model, tokenizer, args):
    """The FastAPI app serving `model` (a causal LM in eval mode) with `tokenizer`'s chat template; `args` holds the
    request defaults (temperature, top_p, max_new_tokens, open_thinking), served_model_name and the limits
    (api_key, max_waiting, request_timeout, max_prompt_tokens, max_request_bytes). app.state.engine runs it."""
    app = FastAPI(title="MiniMind-4D", dependencies=[Depends(key_check(args.api_key))])
    engine = app.state.engine = Engine(model, tokenizer, args.max_waiting, args.request_timeout)
    context = model.config.max_position_embeddings
    max_prompt = min(args.max_prompt_tokens or context - 1, context - 1)
    name, created = args.served_model_name, int(time.time())
    add_error_handlers(app)

    def prompt_ids(request, thinking):
        try:
            text = render_prompt(tokenizer, [text_content(m) for m in request.messages], chat=True,
                                 open_thinking=thinking, tools=request.tools)
        except Exception as e:  # the template's own message (a missing role, a bad tool schema)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from e
        return tokenizer(text, add_special_tokens=False).input_ids

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "minimind"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        try:
            request = parse_request(await read_body(raw, args.max_request_bytes))
            wanted = settings(request, args)
            ids = await run_in_threadpool(prompt_ids, request, wanted.thinking)  # a long prompt: off the event loop
            max_tokens = fit_max_tokens(wanted.max_tokens, args.max_new_tokens, len(ids), context, max_prompt)
            if wanted.min_tokens > max_tokens:
                raise RequestError(f"min_tokens must be at most max_tokens ({max_tokens})", "min_tokens")
            job = engine.submit(Generation(ids, max_tokens, wanted.temperature, wanted.top_p, wanted.seed, wanted.n,
                                           wanted.stop, wanted.min_tokens))
        except RequestError as e:
            return error_response(str(e), e.param, e.status)
        except Full:
            return error_response("the server is busy (its queue is full) or shutting down; retry later",
                                  status=503, error_type="server_error", headers={"Retry-After": "1"})
        reply = Reply(name, tokenizer, wanted, max_tokens, len(ids))
        if request.stream:
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            return JobStream(job, event_lines(job, reply, include_usage))
        return await whole_reply(job, reply, raw)

    return app


class Server(uvicorn.Server):
    """uvicorn's server; a signal also stops the running generation at its next token and the waiting ones, so a
    shutdown takes seconds, not the rest of a long reply."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.close()
        super().handle_exit(sig, frame)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="OpenAI-compatible server for MiniMind models")
    add_model_args(parser, weight="full_sft")
    add_sampling_args(parser, max_new_tokens=1024, temperature=0.85)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines too (then set --api_key)")
    parser.add_argument("--port", type=int, default=8998)
    parser.add_argument("--served_model_name", default="minimind", help="the model id /v1/models lists")
    parser.add_argument("--api_key", default=None, help="clients must send Authorization: Bearer KEY (default: off)")
    parser.add_argument("--max_waiting", type=int, default=16,
                        help="requests that may wait behind the running one; more get 503 with Retry-After")
    parser.add_argument("--request_timeout", type=float, default=300,
                        help="seconds one request may generate (all its choices); then it ends, finish_reason length")
    parser.add_argument("--max_prompt_tokens", type=int, default=None, help="default: the model's context less one")
    parser.add_argument("--max_request_bytes", type=int, default=1_000_000, help="a larger body gets 413")
    return parsed(parser, argv)


def check_serve_args(args):
    """The server's own flags in range: the one `error:` line for the first that is not, else None."""
    if not 1 <= args.port <= 65535:
        return f"--port must be in 1..65535 (got {args.port})"
    for flag, value, low in (("max_waiting", args.max_waiting, 0), ("max_request_bytes", args.max_request_bytes, 1),
                             ("max_prompt_tokens", args.max_prompt_tokens or 1, 1)):
        if value < low:
            return f"--{flag} must be at least {low} (got {value})"
    if not args.request_timeout > 0:
        return f"--request_timeout must be more than 0 seconds (got {args.request_timeout})"
    return None


def listening(host, port):
    """A socket bound to host:port, or one `error:` line and exit 2 (a port in use, a host not on this machine)."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        print(f"error: cannot listen on {host}:{port} ({reason}); pass another --port or --host",
              file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    problem = check_serve_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    model, tokenizer = load_or_exit(args)
    torch.manual_seed(args.seed)
    sock = listening(args.host, args.port)
    app = create_app(model, tokenizer, args)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=5)
    Server(config, app.state.engine).run(sockets=[sock])


if __name__ == "__main__":
    main()
