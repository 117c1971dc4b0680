"""A real HTTP server (http.server in a thread) standing in for SGLang/vLLM in the RL tests: /v1/completions answers
fixed completions (a pure function of the prompt's token ids and the choice's index), the weight-loading endpoints
record the folder they were asked to load."""
import hashlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.launch import demo_slice, forked, read_metrics

EOS = 2
VOCAB = range(3, 6400)


def fixed_completion(prompt, index, max_tokens):
    """(token ids, finish_reason): 1..max_tokens tokens from a seed of (prompt, index); those shorter than
    max_tokens end with EOS ("stop"), the others are cut ("length")."""
    digest = hashlib.sha256(json.dumps([prompt, index]).encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    length = rng.randint(1, max_tokens)
    tokens = [rng.choice(VOCAB) for _ in range(length)]
    if length < max_tokens or rng.random() < 0.5:
        tokens[-1] = EOS
        return tokens, "stop"
    return tokens, "length"


class RolloutServer:
    """Serves on 127.0.0.1:<port> until close(); `requests` and `loads` record what it was sent.
    ids_as: "token_ids" (vLLM's return_token_ids) or "logprob_tokens" (return_tokens_as_token_ids)."""

    def __init__(self, ids_as="token_ids", drop_eos=False):
        self.requests, self.loads, self.ids_as, self.drop_eos = [], [], ids_as, drop_eos
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/completions":
                    server.requests.append(payload)
                    body = server.completions(payload)
                else:
                    server.loads.append((self.path, payload))
                    body = {"success": True}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def completions(self, payload):
        choices = []
        for p, prompt in enumerate(payload["prompt"]):
            for j in range(payload["n"]):
                tokens, finish = fixed_completion(prompt, j, payload["max_tokens"])
                if self.drop_eos and finish == "stop":
                    tokens = tokens[:-1]
                logprobs = [-0.5 - 0.01 * k for k in range(len(tokens))]
                choice = {"index": p * payload["n"] + j, "text": "", "finish_reason": finish,
                          "logprobs": {"token_logprobs": logprobs}}
                if self.ids_as == "token_ids":
                    choice["token_ids"] = tokens
                else:
                    choice["logprobs"]["tokens"] = [f"token_id:{t}" for t in tokens]
                choices.append(choice)
        random.Random(len(choices)).shuffle(choices)  # clients order by index, as the API says
        return {"object": "text_completion", "choices": choices}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# SGD: an update is linear in the gradient, so the layouts' fp32 reduction differences stay at rounding size in the
# later steps; AdamW's first update is lr * sign(g), which turns the rounding of a near-zero gradient into a whole lr
LAYOUT_OPTIMIZER = ["--optimizer", "sgd", "--momentum", "0", "--learning_rate", "0.5"]
LAYOUTS = dict(zero3=["--zero_stage", "3"], tp2=["--tp", "2"], pp2=["--pp", "2"])


def metrics_of(argv):
    return read_metrics(argv[argv.index("--metrics_file") + 1])


def served_run(script, run_flags, tmp_path, server, data=None, layout=None):
    """One run of an RL stage on `server`'s completions: one process, or two under `layout` (a LAYOUTS key);
    run_flags(tmp_path, name, data, dp, extra) gives its flags. Returns (data, its records)."""
    data = data or demo_slice(tmp_path, "rlaif", 40)
    flags = LAYOUTS[layout] if layout else []
    dp = 1 if flags and flags[0] in ("--tp", "--pp") else 2 if layout else 1
    argv = run_flags(tmp_path, layout or "single", data, dp=dp, extra=[
        "--rollout_engine", "vllm", "--rollout_url", server.url, *LAYOUT_OPTIMIZER, *flags])
    proc = forked(script, argv, nproc=2 if layout else 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data, metrics_of(argv)
