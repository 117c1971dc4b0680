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
One generation at a time (scripts/serve/engine.py); --max_waiting more wait, others get 503 with Retry-After. Limits:
--max_request_bytes (413), --max_prompt_tokens and the model's context (400), --request_timeout. Every refusal is
OpenAI's error object. docs/serving.md has the whole story; the server itself is scripts/serve/ (engine,
requests, replies, app).
"""
import argparse
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers, FastAPI and the model")

import torch  # noqa: E402
import uvicorn  # noqa: E402

from scripts.inference.flags import add_model_args, add_sampling_args, parsed  # noqa: E402
from scripts.inference.load import load_or_exit  # noqa: E402
from scripts.serve.app import Server, check_serve_args, create_app, listening  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here



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


def address_line(args, sock):
    """The one line saying where the server listens (the bound socket's port: --port 0 takes a free one), its API
    path and whether requests need the API key."""
    host, port = args.host, sock.getsockname()[1]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    key = ("required: send Authorization: Bearer <its --api_key>" if args.api_key is not None else
           "not required (--api_key sets one)")
    return f"serving {args.served_model_name} at {url} (POST {url}/chat/completions, GET {url}/models); API key {key}"


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
    print(address_line(args, sock), flush=True)  # uvicorn, handed a socket, names no address
    # no lifespan handlers here: off, so a second Ctrl-C (uvicorn's forced exit) cancels no lifespan task that logs it
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=5, lifespan="off")
    server = Server(config, app.state.engine)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on; asyncio turns it into this
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a further Ctrl-C while leaving: no second traceback
        sys.exit(130)
    if signal.SIGINT in server.signals:  # the re-raised SIGINT only cancelled asyncio's finished task: still 130
        sys.exit(130)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the second Ctrl-C landing inside main's own handler, before it ignores a third
        sys.exit(130)
