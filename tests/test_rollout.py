"""The rollout engine (trainer/rl/rollout.py): sampled log-probs against a full forward at the sampling temperature,
EOS and padding, seeding, nucleus sampling, and the HTTP backend against a real local server."""
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.launch import spawn
from tests.helpers.rollout_server import EOS, RolloutServer, fixed_completion
from trainer.parallel.expert import apply_expert_parallel
from trainer.parallel.mesh import ParallelDims
from trainer.rl.rollout import (
    HttpEngine,
    InProcessEngine,
    draw,
    repeat_prompts,
    rollout_seed,
    sample,
    sample_tokens,
    whole_model,
)

CONFIG = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
EOS_BIAS = 3.0  # at temperature 0.7 about one step in 70 ends a completion: rows stop at different steps


class EosBiased(torch.nn.Module):
    """The real model with EOS's logit raised, so a short rollout holds finished and unfinished rows."""

    def __init__(self, model, bias=EOS_BIAS):
        super().__init__()
        self.model, self.bias = model, bias

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        out.logits[..., EOS] += self.bias
        return out


def prompts():
    """Four left-padded prompts of 20, 12, 7 and 15 tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG.vocab_size, (4, 20), generator=generator)
    lengths = torch.tensor([20, 12, 7, 15])
    for row, n in enumerate(lengths.tolist()):
        ids[row, :20 - n] = 0
    return ids, lengths


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return EosBiased(MiniMindForCausalLM(CONFIG).eval())


def test_sampled_log_probs_are_a_full_forward_at_the_temperature(model):
    """Each sampled token's log-prob equals log_softmax(logits / T) of one forward over prompt + completion (no
    padding, no cache); a row ends at its EOS, padded after it, and one without EOS is marked truncated."""
    temperature = 0.7
    ids, lengths = repeat_prompts(*prompts(), 3)
    rollout = sample(model, ids, lengths, 40, temperature, 1.0, EOS, 0, torch.Generator().manual_seed(1))
    finished = ~rollout.truncated
    assert finished.any() and rollout.truncated.any()  # both kinds of row are tested
    for row in range(ids.shape[0]):
        p, c = int(lengths[row]), int(rollout.completion_lengths[row])
        completion = rollout.completion_ids[row, :c]
        assert bool((completion == EOS).any()) == bool(finished[row])
        if finished[row]:
            assert completion[-1] == EOS and not (completion[:-1] == EOS).any()
        else:
            assert c == 40
        assert (rollout.completion_ids[row, c:] == 0).all() and (rollout.logprobs[row, c:] == 0).all()
        assert rollout.completion_mask[row].sum() == c
        with torch.no_grad():
            logits = model(torch.cat([ids[row, ids.shape[1] - p:], completion])[None]).logits[0].double()
        expected = torch.log_softmax(logits / temperature, -1)[p - 1:p - 1 + c].gather(1, completion[:, None])[:, 0]
        # fp32 cached decoding against one fp32 forward: other matmul shapes, log-probs of size ~9: a few ulp
        assert torch.allclose(rollout.logprobs[row, :c].double(), expected, atol=1e-5), row


def decode_by_full_forwards(model, ids, lengths, new_tokens, temperature, top_p, generator):
    """The rollout without a KV cache or padding: each step one forward per row over its own prompt and the tokens so
    far, the last logits stacked and drawn from by sample_tokens with `generator`; (tokens, log-probs, lengths)."""
    rows = ids.shape[0]
    tokens, log_probs = torch.zeros(rows, new_tokens, dtype=torch.long), torch.zeros(rows, new_tokens)
    done, count = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.long)
    for t in range(new_tokens):
        with torch.no_grad():
            logits = torch.stack([model(torch.cat([ids[r, ids.shape[1] - int(lengths[r]):], tokens[r, :t]])[None])
                                  .logits[0, -1] for r in range(rows)])
        new, new_log_probs = sample_tokens(logits, temperature, top_p, generator)
        tokens[:, t], log_probs[:, t] = torch.where(done, 0, new), torch.where(done, 0.0, new_log_probs)
        count += (~done).long()
        done |= new == EOS
        if done.all():
            break
    return tokens[:, :int(count.max())], log_probs[:, :int(count.max())], count


@pytest.mark.parametrize("padded,top_p,group", [(True, 1.0, 1), (True, 1e-6, 1), (False, 0.9, 1), (True, 1.0, 2)])
def test_cached_decoding_draws_what_full_forwards_draw(model, padded, top_p, group):
    """Under one generator seed, the rollout's tokens are those of a decode by full forwards without a cache (each
    row alone, no padding), its log-probs theirs within fp32 rounding: the KV cache, the decode mask over left padding
    and the positions change nothing; nor does running each prompt once for its group of 2 rows (group 2). top_p 1e-6
    keeps one token: greedy decoding (of the unbiased model, whose top token is not EOS)."""
    model = model if top_p > 1e-6 else model.model
    ids, lengths = repeat_prompts(*prompts(), 2)
    if not padded:  # every prompt full width: the decode runs without a mask
        ids, lengths = ids[lengths == 20], lengths[lengths == 20]
    rollout = sample(model, ids, lengths, 24, 0.7, top_p, EOS, 0, torch.Generator().manual_seed(3), group=group)
    tokens, log_probs, count = decode_by_full_forwards(model, ids, lengths, 24, 0.7, top_p,
                                                       torch.Generator().manual_seed(3))
    assert torch.equal(rollout.completion_ids, tokens) and torch.equal(rollout.completion_lengths, count)
    # fp32 cached decoding against fp32 forwards of other shapes: log-probs of size ~9 agree to a few ulp
    assert torch.allclose(rollout.logprobs.double(), log_probs.double(), atol=1e-5)
    assert count.min() < count.max() or not padded or top_p == 1e-6  # rows that stop at different steps


def test_the_in_process_engine_samples_what_sample_does_in_ordinary_tensors(model):
    """InProcessEngine.generate (its decode in inference mode) gives sample's rollout under the seed, bit for bit,
    as ordinary tensors that training may save for backward or change in place."""
    ids, lengths = prompts()
    engine = InProcessEngine(16, 0.7, 1.0, EOS, 0, autocast=nullcontext)
    got = engine.generate([model], ids, lengths, 2, seed=5)
    want = sample(model, *repeat_prompts(ids, lengths, 2), 16, 0.7, 1.0, EOS, 0, torch.Generator().manual_seed(5))
    for name in ("prompt_ids", "prompt_lengths", "completion_ids", "completion_lengths", "logprobs", "truncated"):
        assert torch.equal(getattr(got, name), getattr(want, name)) and not getattr(got, name).is_inference(), name


def test_the_same_seed_repeats_a_rollout_and_another_does_not(model):
    ids, lengths = repeat_prompts(*prompts(), 2)
    runs = [sample(model, ids, lengths, 12, 0.8, 1.0, EOS, 0, torch.Generator().manual_seed(seed))
            for seed in (rollout_seed(42, 3, 0), rollout_seed(42, 3, 0), rollout_seed(42, 3, 1))]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].completion_ids, runs[2].completion_ids)
    assert len({rollout_seed(42, s, r, m) for s in range(3) for r in range(3) for m in range(3)}) == 27


def test_nucleus_sampling_keeps_to_the_smallest_set_reaching_top_p():
    """Over many draws, only tokens inside the nucleus (by hand: sorted probabilities, cumulative mass before the
    token below top_p) are sampled; the log-probs are the untruncated distribution's, as the trainer's forward."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(2000, 1)
    probs = torch.softmax(logits[0] / 0.9, -1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[before < 0.8].tolist())
    tokens, log_probs = sample_tokens(logits, 0.9, 0.8, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == nucleus and len(nucleus) < 6
    assert torch.allclose(log_probs, probs.log()[tokens])



def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    """draw's frequencies over 200k rows match the (unnormalised) probabilities within 5 binomial standard deviations,
    computed by hand; tokens of probability 0, first, inside and last, are never drawn."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.0])
    n = 200_000
    tokens = draw(weights.repeat(n, 1), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=8).double()
    p = weights.double() / weights.double().sum()
    assert (counts[p == 0] == 0).all()
    assert ((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all(), counts / n


@pytest.mark.parametrize("ids_as,drop_eos", [("token_ids", False), ("logprob_tokens", True)])
def test_http_engine_reads_the_servers_completions(tokenizer, ids_as, drop_eos):
    """Completion ids as vLLM returns them (token_ids, or "token_id:N" log-prob tokens), in index order, EOS put back
    where a server drops it, the log-probs it sent; one request for the prompts, n completions each."""
    server = RolloutServer(ids_as=ids_as, drop_eos=drop_eos)
    try:
        engine = HttpEngine("vllm", server.url, "", tokenizer, 6, 0.8, 1.0, 30, ParallelDims(), torch.float32)
        ids, lengths = prompts()
        rollout = engine.generate(None, ids, lengths, 3, seed=7)
    finally:
        server.close()
    (request,) = server.requests
    assert request["n"] == 3 and request["max_tokens"] == 6 and request["temperature"] == 0.8
    assert request["prompt"] == [ids[i, 20 - n:].tolist() for i, n in enumerate(lengths.tolist())]
    for row in range(12):
        expected, finish = fixed_completion(request["prompt"][row // 3], row % 3, 6)
        c = int(rollout.completion_lengths[row])
        assert rollout.completion_ids[row, :c].tolist() == expected
        assert bool(rollout.truncated[row]) == (finish == "length")
        sent = [-0.5 - 0.01 * k for k in range(len(expected) - (drop_eos and finish == "stop"))]
        assert rollout.logprobs[row, :len(sent)].tolist() == pytest.approx(sent)
    assert torch.equal(rollout.prompt_lengths, lengths.repeat_interleave(3))


def test_http_engine_syncs_the_policy_as_a_loadable_hf_folder(tmp_path, tokenizer):
    """Before a rollout on new weights the policy is written as a Qwen3 folder that transformers loads to the same
    logits, and the server is asked to load that folder (SGLang's request); once per step."""
    server = RolloutServer()
    torch.manual_seed(3)
    policy = MiniMindForCausalLM(CONFIG)
    trainer = SimpleNamespace(progress=SimpleNamespace(global_step=5), model_parts=[policy], config=CONFIG)
    folder = str(tmp_path / "export")
    try:
        engine = HttpEngine("sglang", server.url, folder, tokenizer, 6, 0.8, 1.0, 30, ParallelDims(), torch.float32)
        engine.sync(trainer)
        engine.sync(trainer)
    finally:
        server.close()
    assert server.loads == [("/update_weights_from_disk", {"model_path": os.path.abspath(folder)})]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # fp32 both ways, two implementations of one model: reduction order only
        assert (loaded(ids).logits - policy(ids).logits).abs().max().item() < 1e-4
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == tokenizer.get_vocab()


def _zero3_rollout_worker(rank, world_size, out_dir):
    """Each rank samples its own prompts (so it stops at its own step) from the ZeRO-3 model gathered by whole_model,
    then from a plain copy of the same weights; both rollouts are saved for the test to compare."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.data import apply_data_parallel
    torch.manual_seed(0)
    plain = MiniMindForCausalLM(CONFIG).eval()
    sharded = MiniMindForCausalLM(CONFIG)
    sharded.load_state_dict(plain.state_dict())
    sharded = apply_data_parallel(sharded, init_device_mesh("cpu", (world_size,)), zero_stage=3)
    ids, lengths = repeat_prompts(*prompts(), 2)
    ids, lengths = ids[rank::world_size], lengths[rank::world_size]
    seed = rollout_seed(42, 1, rank)
    with whole_model([sharded]) as model:
        gathered = sample(EosBiased(model, 5.0), ids, lengths, 60, 0.7, 1.0, EOS, 0,
                          torch.Generator().manual_seed(seed))
    reference = sample(EosBiased(plain, 5.0), ids, lengths, 60, 0.7, 1.0, EOS, 0, torch.Generator().manual_seed(seed))
    x = torch.randint(3, CONFIG.vocab_size, (2, 8))
    sharded(x).logits.sum().backward()  # training works again after the rollout: resharded, hooks intact
    torch.save(dict(gathered=gathered, reference=reference, grad=sharded.lm_head.weight.grad is not None),
               os.path.join(out_dir, f"rank{rank}.pt"))


def _ep_rollout_worker(rank, world_size, out_dir):
    """Each rank samples its own prompts from a MoE model whose experts are split over the 2 ranks (every forward an
    all-to-all), decoding in step with the other rank (stop_group), then from a plain copy of the same weights."""
    torch.manual_seed(0)
    config = MiniMindConfig(**{**CONFIG.to_dict(), "use_moe": True, "num_experts": 4, "num_experts_per_tok": 2})
    plain = MiniMindForCausalLM(config).eval()
    sharded = MiniMindForCausalLM(config).eval()
    sharded.load_state_dict(plain.state_dict())
    apply_expert_parallel(sharded, dist.group.WORLD)
    ids, lengths = repeat_prompts(*prompts(), 2)
    ids, lengths = ids[rank::world_size], lengths[rank::world_size]
    seed = rollout_seed(42, 1, rank)
    sharded_out = sample(EosBiased(sharded, 5.0), ids, lengths, 60, 0.7, 1.0, EOS, 0,
                         torch.Generator().manual_seed(seed), stop_group=dist.group.WORLD)
    reference = sample(EosBiased(plain, 5.0), ids, lengths, 60, 0.7, 1.0, EOS, 0, torch.Generator().manual_seed(seed))
    torch.save(dict(sharded=sharded_out, reference=reference), os.path.join(out_dir, f"rank{rank}.pt"))


def test_expert_parallel_rollouts_decode_in_step_and_equal_the_whole_model(tmp_path):
    """Under --ep each rank's completions are the whole model's, though the ranks finish at different steps (the one
    done first keeps joining the all-to-alls until the other is done; without that it would wait forever)."""
    spawn(_ep_rollout_worker, 2, str(tmp_path), timeout=120, start_method="fork")
    steps = set()
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        got, reference = saved["sharded"], saved["reference"]
        assert torch.equal(got.completion_ids, reference.completion_ids)
        assert torch.equal(got.completion_lengths, reference.completion_lengths)
        assert torch.allclose(got.logprobs, reference.logprobs, atol=1e-5)
        steps.add(int(reference.completion_lengths.max()))
    assert len(steps) == 2  # the ranks' own rows finish at different steps


def test_zero3_rollouts_run_on_the_gathered_weights(tmp_path):
    """Under ZeRO-3 each rank generates from the gathered weights, stopping at its own step with no collective in
    between, what a plain model with the same weights generates."""
    spawn(_zero3_rollout_worker, 2, str(tmp_path), timeout=120, start_method="fork")
    steps = set()
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        gathered, reference = saved["gathered"], saved["reference"]
        assert torch.equal(gathered.completion_ids, reference.completion_ids) and saved["grad"]
        assert torch.allclose(gathered.logprobs, reference.logprobs, atol=1e-6)
        steps.add(int(gathered.completion_lengths.max()))
    assert len(steps) == 2  # the ranks stopped at different steps
