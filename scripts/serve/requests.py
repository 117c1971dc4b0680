"""What the chat server accepts: OpenAI's chat completion request, checked field by field into one 400 line naming the
field; the body size, prompt and context limits; OpenAI's error object for every refusal; stop strings."""
import math
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

ROLES = ("system", "user", "assistant", "tool")  # what the chat template renders
MAX_N = 8  # choices per request: they run one after another on the one model copy
MAX_STOP = 4  # OpenAI's limit on stop strings


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request this server reads (others are accepted and ignored), with
    vLLM's min_tokens and the thinking switch."""
    model: str | None = None
    messages: list
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stop: str | list | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    tools: list[dict] | None = None
    open_thinking: bool | None = None
    chat_template_kwargs: dict | None = None
    min_tokens: int = 0


class RequestError(ValueError):
    """A request the server refuses: `status` (400, 413) and the field it names."""

    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Settings:
    """A request's checked settings, the server's flags filling in what it leaves out."""
    temperature: float
    top_p: float
    max_tokens: int | None  # None: as many as the flag and the context allow
    thinking: bool
    n: int
    stop: list
    seed: int | None
    min_tokens: int


def error_response(message, param=None, status=400, error_type="invalid_request_error", code=None, headers=None):
    """OpenAI's error object (what the `openai` client parses) with `status`."""
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": error_type, "param": param, "code": code}})


async def read_body(request, limit):
    """The request's body; a RequestError (413) as soon as it passes `limit` bytes, before the rest is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body is {int(declared)} bytes; this server takes at most {limit} "
                           "(--max_request_bytes)", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"the request body is over {limit} bytes (--max_request_bytes)", status=413)
    return bytes(body)


def parse_request(body):
    """The body as a ChatRequest; bad JSON or a field of the wrong type is a RequestError naming it."""
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestError(f"the request body is not valid JSON: {first['msg']}") from None
        where = ".".join(map(str, first["loc"])) or "the request body"
        raise RequestError(f"{where}: {first['msg']} (got {str(first.get('input'))[:80]!r})",
                           str(first["loc"][0]) if first["loc"] else None) from None


def kind(value):
    return "null" if value is None else type(value).__name__


def check_messages(messages):
    """OpenAI's message schema as far as the template reads it: a known role; content a string or a list of text
    parts (an assistant's may be null: a turn that only calls tools)."""
    if not messages:
        raise RequestError("messages must hold at least one message", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with role and content (got {kind(message)})",
                               "messages")
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {message.get('role')!r})",
                               "messages")
        content = message.get("content")
        if isinstance(content, str) or (content is None and message["role"] == "assistant"):
            continue
        if isinstance(content, list) and content and all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content):
            continue
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts "
                           f'({{"type": "text", "text": ...}}); got {kind(content)}', "messages")


def check_stop(stop):
    """`stop` as a list of up to MAX_STOP non-empty strings."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    return stops


def settings(request, args):
    """The request's Settings, each value checked (a RequestError naming the field)."""
    temperature = args.temperature if request.temperature is None else request.temperature
    top_p = args.top_p if request.top_p is None else request.top_p
    given = [n for n in (request.max_completion_tokens, request.max_tokens) if n is not None]
    n = 1 if request.n is None else request.n
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"temperature must be a finite number, 0 (greedy) or more (got {temperature})",
                           "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1] (got {top_p})", "top_p")
    if given and given[0] < 1:
        raise RequestError(f"max_tokens must be at least 1 (got {given[0]})", "max_tokens")
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be in 1..{MAX_N} (got {n})", "n")
    if request.seed is not None and not 0 <= request.seed < 2 ** 32:
        raise RequestError(f"seed must be in [0, 2**32) (got {request.seed})", "seed")
    if request.min_tokens < 0:
        raise RequestError(f"min_tokens must be 0 or more (got {request.min_tokens})", "min_tokens")
    check_messages(request.messages)
    kwargs = request.chat_template_kwargs or {}
    thinking = request.open_thinking
    if thinking is None:
        thinking = kwargs.get("open_thinking", kwargs.get("enable_thinking", bool(args.open_thinking)))
    return Settings(temperature, top_p, given[0] if given else None, bool(thinking), n, check_stop(request.stop),
                    request.seed, request.min_tokens)


def fit_max_tokens(wanted, default, prompt_tokens, context, max_prompt):
    """The completion's token budget: the request's max_tokens if prompt + it fits the model's context (else a 400 in
    vLLM's words), the flag's default cut to the room left; a prompt over `max_prompt` tokens is refused."""
    if prompt_tokens > max_prompt:
        raise RequestError(f"the prompt is {prompt_tokens} tokens; this server takes at most {max_prompt} "
                           "(--max_prompt_tokens)", "messages")
    room = context - prompt_tokens
    if wanted is None:
        return min(default, room)
    if wanted > room:
        raise RequestError(f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in the "
                           "completion). Please reduce the length of the messages or completion.", "max_tokens")
    return wanted


def text_content(message):
    """A message whose content is OpenAI's list of parts, as the text of its parts (the template reads strings)."""
    if isinstance(message.get("content"), list):
        return dict(message, content="".join(part["text"] for part in message["content"]))
    return message


def cut_at_stop(text, stops, final):
    """(`text` up to its first stop string, whether one was found); while generating (final False) a tail that may
    be the start of a stop string is held back too, so what was sent never needs taking back."""
    found = [text.find(s) for s in stops if s in text]
    if found:
        return text[:min(found)], True
    if final:
        return text, False
    held = max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - held], False
