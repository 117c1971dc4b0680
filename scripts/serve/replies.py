"""The chat server's replies in OpenAI's shapes: a whole chat.completion, or the chunks of a stream (server-sent
events), built from the token ids the engine sends for each choice."""
import json
import time
import uuid

from dataset.tools import parse_assistant
from scripts.serve.requests import cut_at_stop


class Reply:
    """The shape of one request's reply: its id, the choices' token ids as they come, chunks and finished choices."""

    def __init__(self, name, tokenizer, wanted, max_tokens, prompt_tokens):
        self.id, self.created, self.name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), name
        self.tokenizer, self.wanted, self.max_tokens, self.prompt_tokens = tokenizer, wanted, max_tokens, prompt_tokens
        self.ids = [[] for _ in range(wanted.n)]

    def turn(self, index, final):
        """(the choice's parsed turn, whether a stop string ended it)."""
        text, hit = cut_at_stop(self.tokenizer.decode(self.ids[index], skip_special_tokens=True), self.wanted.stop,
                                final)
        return parse_assistant(text, self.wanted.thinking, final=final), hit

    def finish_reason(self, index, turn, hit):
        """tool_calls when the reply calls a tool; stop at EOS or a stop string; else length (max_tokens, the time
        limit or a shutdown cut it)."""
        if turn.tool_calls:
            return "tool_calls"
        ids = self.ids[index]
        return "stop" if hit or (ids and ids[-1] == self.tokenizer.eos_token_id) else "length"

    def usage(self):
        completion = sum(map(len, self.ids))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def chunk(self, index, delta, finish=None):
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.name,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def whole(self):
        choices = []
        for index in range(self.wanted.n):
            turn, hit = self.turn(index, final=True)
            turn.tool_calls = with_unique_ids(turn.tool_calls)
            choices.append({"index": index, "message": turn.message(), "logprobs": None,
                            "finish_reason": self.finish_reason(index, turn, hit)})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.name,
                "choices": choices, "usage": self.usage()}


def with_unique_ids(calls):
    """The parsed calls with ids unique across the conversation (the client answers each by its id)."""
    return [dict(call, id=f"call_{uuid.uuid4().hex[:24]}") for call in calls]


async def batches(job):
    """The job's events in lists of all that have arrived (a slow reader decodes once per list, not per token),
    until it is done; an error of the generation is raised here."""
    while True:
        batch = [await job.events.get()]
        while not job.events.empty():
            batch.append(job.events.get_nowait())
        if batch[-1][0] == "done":
            yield batch[:-1]
            if batch[-1][1] is not None:
                raise batch[-1][1]
            return
        yield batch


async def stream_chunks(job, reply, include_usage):
    """The chunks of a streamed reply, choice after choice: role, reasoning/content deltas that only grow (the
    partial parse, a possible stop string held back), the tool calls once whole, the finish reason; usage if asked."""
    sent = [{"reasoning_content": "", "content": ""} for _ in range(reply.wanted.n)]

    def deltas(index, turn):
        for key, before in sent[index].items():
            value = getattr(turn, key) or ""
            if len(value) > len(before):
                yield reply.chunk(index, {key: value[len(before):]})
                sent[index][key] = value

    yield reply.chunk(0, {"role": "assistant", "content": ""})
    async for batch in batches(job):
        pending = None  # the choice with tokens not parsed yet
        for kind, index, token in batch:
            if kind == "token":
                reply.ids[index].append(token)
                pending = index
                continue
            turn, hit = reply.turn(index, final=True)
            for chunk in deltas(index, turn):
                yield chunk
            if turn.tool_calls:
                calls = [dict(call, index=i) for i, call in enumerate(with_unique_ids(turn.tool_calls))]
                yield reply.chunk(index, {"tool_calls": calls})
            yield reply.chunk(index, {}, reply.finish_reason(index, turn, hit))
            pending = None
            if index + 1 < reply.wanted.n:
                yield reply.chunk(index + 1, {"role": "assistant", "content": ""})
        if pending is not None:
            for chunk in deltas(pending, reply.turn(pending, final=False)[0]):
                yield chunk
    if include_usage:
        yield dict(reply.chunk(0, {}), choices=[], usage=reply.usage())


async def event_lines(job, reply, include_usage):
    """The server-sent events of a streamed reply; an error during generation is an error event (the status was
    sent already)."""
    try:
        async for chunk in stream_chunks(job, reply, include_usage):
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as e:  # the headers are sent: the error goes in the stream, as vLLM sends it
        error = {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
