"""The chat server's app: the FastAPI routes (/v1/chat/completions, /v1/models) over the engine
(scripts/serve/engine.py), the API key check, OpenAI's error object for what FastAPI refuses itself, the server's own
flags and its socket, and uvicorn's server that stops the running generation on a signal."""
import asyncio
import hmac
import os
import socket
import sys
import time

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dataset.prompt_ids import prompt_ids
from scripts.inference.generate import render_prompt
from scripts.serve.engine import Engine, Full, Generation
from scripts.serve.replies import Reply, batches, event_lines
from scripts.serve.requests import (
    RequestError,
    error_response,
    fit_max_tokens,
    parse_request,
    read_body,
    settings,
    text_content,
)


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

    def request_ids(request, thinking):
        try:
            text = render_prompt(tokenizer, [text_content(m) for m in request.messages], chat=True,
                                 open_thinking=thinking, tools=request.tools)
        except Exception as e:  # the template's own message (a missing role, a bad tool schema)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from e
        return prompt_ids(tokenizer, text)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "minimind"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        try:
            request = parse_request(await read_body(raw, args.max_request_bytes))
            wanted = settings(request, args)
            ids = await run_in_threadpool(request_ids, request, wanted.thinking)  # a long prompt: off the event loop
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
        self.signals = []  # what stopped it: two quick Ctrl-Cs can arrive as one handler call

    def handle_exit(self, sig, frame):
        self.signals.append(sig)
        self.engine.close()
        super().handle_exit(sig, frame)


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
