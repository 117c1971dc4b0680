"""Render a chat and generate from it: the chat template (thinking switch, tool schemas), whole or streamed token ids
(a closed stream stops generate() at its next token), and a reply streamed to stdout."""
import queue
import threading

import torch
from transformers import TextStreamer
from transformers.generation import BaseStreamer, StoppingCriteria, StoppingCriteriaList

from dataset.prompt_ids import prompt_ids


def render_prompt(tokenizer, messages, chat, open_thinking, tools=None):
    """The text the model continues: the chat template (with the thinking switch and the tool schemas) or bos + raw
    text."""
    if not chat:
        return (tokenizer.bos_token or "") + messages[-1]["content"]
    # MiniMind-3's template reads open_thinking, Qwen3's enable_thinking; a template ignores the one it lacks
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         open_thinking=bool(open_thinking), enable_thinking=bool(open_thinking))


def generate_ids(model, tokenizer, text, max_new_tokens, temperature, top_p, **generate_kwargs):
    """(prompt ids, generated ids, EOS included when reached) of `text`'s continuation: temperature 0 is greedy."""
    ids = torch.tensor([prompt_ids(tokenizer, text)], device=model.device)  # the prompt's tokens as SFT saw them
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **sampling, **generate_kwargs)
    return ids[0].cpu(), out[0, ids.shape[1]:].cpu()


class _TokenQueue(BaseStreamer):
    """generate() hands it the prompt, then each new token; None marks the end."""

    def __init__(self):
        self.tokens, self.prompt_seen = queue.Queue(), False

    def put(self, value):
        if self.prompt_seen:
            for token in value.reshape(-1).tolist():
                self.tokens.put(token)
        self.prompt_seen = True

    def end(self):
        self.tokens.put(None)


class _StopFlag(StoppingCriteria):
    """Stops generate() at the next token once the event is set (a streaming client went away)."""

    def __init__(self, event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_ids(model, tokenizer, text, max_new_tokens, temperature, top_p):
    """Yield the generated token ids (EOS included when reached) as generate() makes them in a thread; the same
    tokens as generate_ids. Closing the generator stops generation at the next token."""
    tokens, stop, failure = _TokenQueue(), threading.Event(), []

    def run():
        try:
            generate_ids(model, tokenizer, text, max_new_tokens, temperature, top_p, streamer=tokens,
                         stopping_criteria=StoppingCriteriaList([_StopFlag(stop)]))
        except Exception as e:  # re-raised in the caller's thread
            failure.append(e)
            tokens.end()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while (token := tokens.tokens.get()) is not None:
            yield token
    finally:
        stop.set()
        thread.join()
    if failure:
        raise failure[0]


def reply(model, tokenizer, text, args):
    """Stream the continuation of `text` to stdout; return it decoded."""
    streamer = ReplyStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    _, new_ids = generate_ids(model, tokenizer, text, args.max_new_tokens, args.temperature, args.top_p,
                              streamer=streamer)
    return tokenizer.decode(new_ids, skip_special_tokens=True)


class ReplyStreamer(TextStreamer):
    """TextStreamer without the reply's leading whitespace (a small model's reply often opens with blank lines)."""

    def on_finalized_text(self, text, stream_end=False):
        if not getattr(self, "started", False):
            text = text.lstrip()
            self.started = bool(text)
        super().on_finalized_text(text, stream_end)
