"""The rollout engine: completions of prompts from the current policy, for the RL stages (trainer/rl/grpo.py).

One interface, `engine.generate(prompt_ids, prompt_lengths, num_generations, seed) -> Rollout`:
- `InProcessEngine` (the default, offline): a sampling loop over a KV cache preallocated for the rollout
  (`GenerationCache`) on the policy being trained, where the model is whole on the rank (one process, DDP, ZeRO-1;
  FSDP2's ZeRO-2/3 gathered for the rollout). Each step samples from softmax(logits / temperature), nucleus-filtered by
  top_p, and keeps the sampled token's log-prob at the sampling temperature (over the whole vocabulary, as the
  trainer's forward computes it; MiniMind takes it at temperature 1).
- `HttpEngine` (`--rollout_engine sglang|vllm --rollout_url`): posts the prompts' token ids to an OpenAI-compatible
  /v1/completions endpoint; before a rollout on changed weights, rank 0 exports the policy as a Hugging Face folder
  and asks the server to load it (MiniMind's way of syncing an SGLang server).
The sampling randomness is a torch.Generator of the engine's own, re-seeded from (seed, step, dp rank, micro-batch)
at every rollout: a resumed run repeats the rollouts of the uninterrupted one.
"""
import hashlib
import json
import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from model.hf_convert import save_hf_folder
from trainer.base.errors import TrainingHalted
from trainer.base.launch import is_main_process
from trainer.parallel.state_dict import full_model_state_dict
from trainer.rl.packed_weights import packed_linears

ENGINES = ("torch", "sglang", "vllm")


@dataclass
class Rollout:
    """`num_generations` completions of each prompt, a prompt's completions adjacent (rows g*G .. g*G+G-1).

    prompt_ids (N, P) left-padded, prompt_lengths (N,); completion_ids (N, R) padded after EOS, completion_lengths
    (N,) counting the EOS; logprobs (N, R) of the sampled tokens at the sampling temperature (0 past the end), or
    None where the engine has none; truncated (N,) no EOS within max_gen_len."""
    prompt_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_ids: torch.Tensor
    completion_lengths: torch.Tensor
    logprobs: Optional[torch.Tensor]
    truncated: torch.Tensor

    @property
    def completion_mask(self):
        """(N, R) 1 on each completion's tokens up to and including its EOS, 0 after."""
        positions = torch.arange(self.completion_ids.shape[1], device=self.completion_ids.device)
        return (positions[None] < self.completion_lengths[:, None]).long()

    @property
    def generated_tokens(self):
        return int(self.completion_lengths.sum())

    def to(self, device):
        return Rollout(*(None if t is None else t.to(device) for t in (
            self.prompt_ids, self.prompt_lengths, self.completion_ids, self.completion_lengths, self.logprobs,
            self.truncated)))


def rollout_seed(seed, step, dp_rank, micro_batch=0):
    """The sampling seed of one rollout: a hash of (seed, step, data-parallel rank, micro-batch), 63 bits."""
    digest = hashlib.sha256(f"{seed}:{step}:{dp_rank}:{micro_batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def repeat_prompts(prompt_ids, prompt_lengths, num_generations):
    """Each prompt's row `num_generations` times, adjacent; the common left padding cut off."""
    width = int(prompt_lengths.max())
    return (prompt_ids[:, prompt_ids.shape[1] - width:].repeat_interleave(num_generations, 0),
            prompt_lengths.repeat_interleave(num_generations, 0))


def left_padded_positions(lengths, width):
    """Position ids of left-padded rows: 0 at each row's first real token, as for the unpadded prompt (the padding
    before it, masked out, numbered 0.. too)."""
    index = torch.arange(width, device=lengths.device)[None]
    start = width - lengths[:, None]
    return torch.where(index >= start, index - start, index)


def sample_tokens(logits, temperature, top_p, generator):
    """(tokens, their log-probs at `temperature` over the whole vocabulary) of one decoding step, logits (N, V)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = log_probs.exp()
    if top_p < 1.0:  # nucleus: the smallest set of most likely tokens whose mass reaches top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    tokens = draw(probs, generator)
    return tokens, log_probs.gather(1, tokens[:, None]).squeeze(1)


def draw(probs, generator):
    """One token per row of `probs` (N, V), non-negative, unnormalised: inverse transform sampling, one uniform per row
    against the row's cumulative sums (torch.multinomial draws an exponential per vocabulary entry, ~17x the time).
    A token of probability 0 is never drawn (its cumulative sum equals the one before; a rounding edge: the argmax)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1)
    return torch.where(probs.gather(1, tokens) > 0, tokens, probs.argmax(-1, keepdim=True)).squeeze(1)


class GenerationCache:
    """A KV cache preallocated for a whole rollout: each layer's keys and values are written in place (no copy of the
    cache per token, as DynamicCache's concatenation makes); `update` returns views of the positions written so far.
    Duck-types the two methods the model's attention calls (get_seq_length, update)."""

    def __init__(self, max_len, group=1):
        self.max_len, self.group, self.keys, self.values, self.lengths = max_len, group, {}, {}, {}

    def get_seq_length(self, layer_idx=0):
        return self.lengths.get(layer_idx, 0)

    def update(self, k, v, layer_idx, cache_kwargs=None):
        if layer_idx not in self.keys:  # the prompts, each run once: its keys copied to the `group` rows that share it
            shape = (k.shape[0] * self.group, k.shape[1], self.max_len, k.shape[3])
            self.keys[layer_idx], self.values[layer_idx] = k.new_empty(shape), v.new_empty(shape)
            self.lengths[layer_idx] = k.shape[2]
            self.keys[layer_idx][:, :, :k.shape[2]] = k.repeat_interleave(self.group, 0)
            self.values[layer_idx][:, :, :k.shape[2]] = v.repeat_interleave(self.group, 0)
            return k, v
        start = self.lengths[layer_idx]
        end = self.lengths[layer_idx] = start + k.shape[2]
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]


@torch.no_grad()
def sample(model, prompt_ids, prompt_lengths, max_new_tokens, temperature, top_p, eos_id, pad_id, generator,
           stop_group=None, group=1):
    """Sample completions of left-padded prompts with a preallocated KV cache; returns a Rollout (one per row).

    The prompt runs once (its padding masked out; with `group` > 1 the rows come in groups of that many copies of one
    prompt, as repeat_prompts gives them, and each prompt runs once for its group), then one token per step for every
    unfinished row; a row that emits EOS is finished and gets `pad_id` after it. Stops when every row is finished; with
    `stop_group` (expert parallel: every forward is an all-to-all over it) when every row of every rank in it is."""
    rows, width = prompt_ids.shape
    device = prompt_ids.device
    cache = GenerationCache(width + max_new_tokens, group)
    real = torch.arange(width + max_new_tokens, device=device)[None] >= width - prompt_lengths[:, None]
    logits = model(prompt_ids[::group], position_ids=left_padded_positions(prompt_lengths[::group], width),
                   attention_mask=real[::group, :width].long(), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1].repeat_interleave(group, 0)
    # every key from the prompt's first real token on is seen: one (rows, 1, 1, keys) mask for the whole decode (the
    # attention cuts it to the keys cached so far); none where no prompt is padded
    decode_mask = None if bool((prompt_lengths == width).all()) else real[:, None, None, :]
    next_position = prompt_lengths.clone()
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    with packed_linears(model, rows):  # every step multiplies `rows` rows by each weight
        for t in range(max_new_tokens):
            new, new_log_probs = sample_tokens(logits, temperature, top_p, generator)
            new = torch.where(done, pad_id, new)
            tokens[:, t], log_probs[:, t] = new, torch.where(done, 0.0, new_log_probs)
            lengths += (~done).long()
            done |= new == eos_id
            if t == max_new_tokens - 1 or all_finished(done, stop_group):
                break
            logits = model(new[:, None], position_ids=next_position[:, None], past_key_values=cache,
                           use_cache=True, attention_mask=decode_mask).logits[:, -1]
            next_position += 1
    width_out = int(lengths.max()) if rows else 0
    return Rollout(prompt_ids, prompt_lengths, tokens[:, :width_out], lengths, log_probs[:, :width_out],
                   ~done)


def all_finished(done, group=None):
    """Whether every row is finished, here and (a collective) on every rank of `group`."""
    finished = done.all()
    if group is not None:
        finished = finished.to(torch.int32)
        dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=group)
    return bool(finished)


@contextmanager
def whole_model(model_parts):
    """The plain module to generate with: DDP's inner module; an FSDP2 model (ZeRO-2/3) gathered for the whole
    rollout (each decoding step would otherwise all-gather, and ranks stop at different steps), resharded after."""
    (model,) = model_parts
    if isinstance(model, DistributedDataParallel):
        yield model.module
        return
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        yield model
        return
    for module in fsdp:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for module in fsdp:
            module.reshard()
        zero3 = not getattr(model, "keep_gathered_across_microbatches", False)
        for module in fsdp:  # back to apply_data_parallel's settings: blocks reshard under ZeRO-3, the root never
            module.set_reshard_after_forward(module is not model and zero3, recurse=False)


class InProcessEngine:
    """Generation by the policy itself (see `sample`), under the training autocast."""

    def __init__(self, max_gen_len, temperature, top_p, eos_id, pad_id, autocast=None, stop_group=None):
        self.max_gen_len, self.temperature, self.top_p = max_gen_len, temperature, top_p
        self.eos_id, self.pad_id, self.autocast = eos_id, pad_id, autocast
        self.generator, self.stop_group = None, stop_group  # the ep group: its ranks decode in step

    def sync(self, trainer):
        """Nothing to do: the engine reads the policy's own parameters."""

    def generate(self, model_parts, prompt_ids, prompt_lengths, num_generations, seed):
        ids, lengths = repeat_prompts(prompt_ids, prompt_lengths, num_generations)
        if self.generator is None or self.generator.device != ids.device:
            self.generator = torch.Generator(ids.device)
        self.generator.manual_seed(seed)
        with whole_model(model_parts) as model:
            was_training = model.training
            model.eval()
            try:  # inference mode: no autograd bookkeeping per op (~5% of a small model's decode step on CPU)
                with self.autocast(), torch.inference_mode():
                    rollout = sample(model, ids, lengths, self.max_gen_len, self.temperature, self.top_p,
                                     self.eos_id, self.pad_id, self.generator, self.stop_group, num_generations)
            finally:
                model.train(was_training)
        # inference tensors cannot be saved for backward nor changed in place: the trainer gets ordinary copies
        return Rollout(*(None if t is None else t.clone() for t in (getattr(rollout, f.name) for f in fields(Rollout))))


# ----------------------------------------------------------------------------- an OpenAI-compatible server
# how each server loads a folder of new weights: SGLang's update_weights_from_disk (MiniMind's way); vLLM re-reads
# the folder it serves through its dev-mode RPC (VLLM_SERVER_DEV_MODE=1; serve the export folder itself)
SYNC_REQUESTS = {"sglang": ("/update_weights_from_disk", lambda folder: {"model_path": folder}),
                 "vllm": ("/collective_rpc", lambda folder: {"method": "reload_weights"})}


def post_json(url, payload, timeout):
    """POST `payload` as JSON to `url`; the decoded JSON reply. A refused or failed request is one line."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise TrainingHalted(f"rollout server: {url} answered {e.code} ({e.read()[:300].decode(errors='replace')})")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TrainingHalted(f"rollout server: {url} failed ({e}); is it running at --rollout_url?")


def choice_tokens(choice, eos_id):
    """(token ids, their log-probs, truncated) of one completion choice. Token ids come from vLLM's `token_ids`
    (return_token_ids) or from the log-prob tokens written as "token_id:N" (return_tokens_as_token_ids); text alone
    cannot be turned back into the sampled ids. A server that drops the EOS it stopped on gets it back (log-prob 0)."""
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None and logprobs.get("tokens") is not None:
        ids = [int(token.rsplit(":", 1)[1]) for token in logprobs["tokens"]]
    if ids is None:
        raise TrainingHalted("rollout server: a completion came back without token ids; the server must honour "
                             "return_token_ids or return_tokens_as_token_ids with logprobs (vLLM does)")
    values = [float(v or 0.0) for v in logprobs.get("token_logprobs") or [0.0] * len(ids)]
    truncated = choice.get("finish_reason") == "length"
    if not truncated and (not ids or ids[-1] != eos_id):
        ids, values = ids + [eos_id], values + [0.0]
    return ids, values, truncated


class HttpEngine:
    """Completions from an OpenAI-compatible server (`--rollout_engine sglang|vllm --rollout_url`).

    Before the first rollout on new weights every rank takes part in gathering the policy; rank 0 writes it as a
    Qwen3 Hugging Face folder and asks the server to load it. One rank per data-parallel replica (tp and pp rank 0)
    requests that replica's completions and shares them with its tp/pp peers, so they train on the same rows."""

    def __init__(self, kind, url, folder, tokenizer, max_gen_len, temperature, top_p, timeout, dims, save_dtype):
        self.kind, self.url, self.folder, self.tokenizer = kind, url.rstrip("/"), folder, tokenizer
        self.max_gen_len, self.temperature, self.top_p, self.timeout = max_gen_len, temperature, top_p, timeout
        self.dims, self.save_dtype, self.synced_step = dims, save_dtype, None

    def sync(self, trainer):
        """Export the policy and have the server load it, once per optimizer step that changed it (a collective)."""
        step = trainer.progress.global_step
        if self.synced_step == step:
            return
        pp_group = self.dims.group("pp") if self.dims.size("pp") > 1 else None
        # each ep rank holds its experts (group("ep") is None without expert parallel)
        state = full_model_state_dict(trainer.model_parts, pp_group=pp_group, ep_group=self.dims.group("ep"))
        if is_main_process():
            folder = os.path.abspath(self.folder)
            save_hf_folder(state, trainer.config, folder, self.save_dtype)
            self.tokenizer.save_pretrained(folder)
            path, payload = SYNC_REQUESTS[self.kind]
            post_json(self.url + path, payload(folder), self.timeout)
        if dist.is_initialized():
            dist.barrier()  # no rank asks for completions before the server holds the new weights
        self.synced_step = step

    def request(self, prompt_ids, prompt_lengths, num_generations, seed):
        """The server's completions of each prompt (n = num_generations), as a Rollout on the CPU."""
        prompts = [ids[len(ids) - n:].tolist() for ids, n in zip(prompt_ids.cpu(), prompt_lengths.tolist())]
        eos_id = self.tokenizer.eos_token_id
        reply = post_json(self.url + "/v1/completions", dict(
            prompt=prompts, n=num_generations, max_tokens=self.max_gen_len, temperature=self.temperature,
            top_p=self.top_p, seed=seed % 2 ** 31, logprobs=0, stop_token_ids=[eos_id], skip_special_tokens=False,
            return_token_ids=True, return_tokens_as_token_ids=True), self.timeout)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts) * num_generations:
            raise TrainingHalted(f"rollout server: {len(choices)} completions for {len(prompts)} prompts x "
                                 f"{num_generations}; check its OpenAI-compatible /v1/completions")
        parsed = [choice_tokens(choice, eos_id) for choice in choices]
        width = max(len(ids) for ids, _, _ in parsed)
        completion_ids = torch.full((len(parsed), width), self.tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(parsed), width)
        for i, (ids, values, _) in enumerate(parsed):
            completion_ids[i, :len(ids)], logprobs[i, :len(values)] = torch.tensor(ids), torch.tensor(values)
        prompt_rows, lengths = repeat_prompts(prompt_ids.cpu(), prompt_lengths.cpu(), num_generations)
        return Rollout(prompt_rows, lengths, completion_ids, torch.tensor([len(ids) for ids, _, _ in parsed]),
                       logprobs, torch.tensor([truncated for _, _, truncated in parsed]))

    def generate(self, model_parts, prompt_ids, prompt_lengths, num_generations, seed):
        dims = self.dims
        rollout = [self.request(prompt_ids, prompt_lengths, num_generations, seed)
                   if dims.rank("tp") == 0 and dims.rank("pp") == 0 else None]
        if dims.size("pp") > 1 and dims.rank("tp") == 0:  # first along the pipeline, then across each stage's tp group
            dist.broadcast_object_list(rollout, src=dist.get_global_rank(dims.group("pp"), 0), group=dims.group("pp"))
        if dims.size("tp") > 1:
            dist.broadcast_object_list(rollout, src=dist.get_global_rank(dims.group("tp"), 0), group=dims.group("tp"))
        return rollout[0]


def make_engine(plan, tokenizer, dims, autocast):
    """The stage's rollout engine: in-process (--rollout_engine torch) or an HTTP server's."""
    stage = plan.stage
    if stage.rollout_engine == "torch":
        return InProcessEngine(stage.max_gen_len, stage.temperature, stage.top_p, tokenizer.eos_token_id,
                               tokenizer.pad_token_id, autocast, dims.group("ep"))
    folder = os.path.join(plan.io.save_dir, f"{plan.io.run_name}_rollout_hf")
    return HttpEngine(stage.rollout_engine, stage.rollout_url, folder, tokenizer, stage.max_gen_len,
                      stage.temperature, stage.top_p, stage.rollout_timeout, dims, plan.io.save_dtype)
