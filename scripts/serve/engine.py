"""The chat server's generation engine: one generation at a time on the one model copy, run by a worker thread that
holds the lock only while it generates. The request's handler never holds it, so a client that goes away, the time
limit or a shutdown always releases it: each stops generate() at its next token. A bounded number of requests wait
their turn; one more is refused (Full: the server answers 503 with Retry-After).
"""
import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers.generation import (
    BaseStreamer,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)


class Full(Exception):
    """Every place in the queue is taken (or the server is shutting down)."""


@dataclass
class Generation:
    """What one request asks for: n continuations of the prompt's token ids, sampled from one seed."""
    prompt_ids: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list = field(default_factory=list)  # strings that end a choice (transformers' stop_strings)
    min_tokens: int = 0  # EOS held back until then (vLLM's min_tokens)


class Job:
    """One request's generation as the event loop sees it: ("token", index, id), ("end", index, None), then
    ("done", error) on an asyncio queue; cancel() stops it at the next token (or before it starts)."""

    def __init__(self, loop):
        self.loop, self.events, self.cancelled = loop, asyncio.Queue(), threading.Event()

    def send(self, event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        self.cancelled.set()


class _Flags(StoppingCriteria):
    """Stops generate() at the next token once any of the events is set (the client left, the server closes)."""

    def __init__(self, *events):
        self.events = events

    def __call__(self, input_ids, scores, **kwargs):
        stop = any(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _Tokens(BaseStreamer):
    """generate() hands it the prompt, then each new token: the tokens go to the job's queue as they come."""

    def __init__(self, job, index):
        self.job, self.index, self.prompt_seen = job, index, False

    def put(self, value):
        if self.prompt_seen:
            for token in value.reshape(-1).tolist():
                self.job.send(("token", self.index, token))
        self.prompt_seen = True

    def end(self):
        pass


class Engine:
    """Runs Generations on `model` one at a time: at most `max_waiting` wait behind the running one; each is cut
    after `time_limit` seconds of generating (all its choices together)."""

    def __init__(self, model, tokenizer, max_waiting, time_limit):
        self.model, self.tokenizer, self.time_limit = model, tokenizer, time_limit
        self.lock = threading.Lock()
        self.places = threading.BoundedSemaphore(max_waiting + 1)  # the running generation and those waiting
        self.closing = threading.Event()

    def submit(self, generation):
        """A started Job for `generation` (call from the event loop); Full when no place is free."""
        if self.closing.is_set() or not self.places.acquire(blocking=False):
            raise Full
        job = Job(asyncio.get_running_loop())
        threading.Thread(target=self._run, args=(job, generation), daemon=True).start()
        return job

    def close(self):
        """Stop the running generation at its next token and every waiting one before it starts (a shutdown)."""
        self.closing.set()

    def _run(self, job, generation):
        error = None
        try:
            if self._take_turn(job):
                try:
                    self._generate(job, generation)
                finally:
                    self.lock.release()
        except Exception as e:  # sent to the handler, which answers 500
            error = e
        finally:
            self.places.release()
            job.send(("done", error))

    def _take_turn(self, job):
        """Wait for the lock; False if the client leaves or the server closes first."""
        while not self.lock.acquire(timeout=0.05):
            if job.cancelled.is_set() or self.closing.is_set():
                return False
        return True

    def _generate(self, job, generation):
        if generation.seed is not None:
            torch.manual_seed(generation.seed)  # under the lock: the n choices repeat for the same seed
        ids = torch.tensor([generation.prompt_ids], device=self.model.device)
        sampling = (dict(do_sample=True, temperature=generation.temperature, top_p=generation.top_p)
                    if generation.temperature > 0 else dict(do_sample=False))
        if generation.min_tokens:
            sampling.update(min_new_tokens=generation.min_tokens)
        started = time.time()
        for index in range(generation.n):
            late = index > 0 and time.time() - started > self.time_limit  # the first choice gets one token at least
            if not (job.cancelled.is_set() or self.closing.is_set() or late):
                criteria = StoppingCriteriaList([_Flags(job.cancelled, self.closing),
                                                 MaxTimeCriteria(self.time_limit, started)])
                if generation.stop:  # built here: generate(tokenizer=...) reaches the model's forward on some versions
                    criteria.append(StopStringCriteria(self.tokenizer, generation.stop))
                with torch.no_grad():
                    self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=generation.max_tokens,
                                        pad_token_id=self.tokenizer.pad_token_id,
                                        eos_token_id=self.tokenizer.eos_token_id, streamer=_Tokens(job, index),
                                        stopping_criteria=criteria, **sampling)
            job.send(("end", index, None))  # a choice cut before it starts (time, client, shutdown) ends empty
