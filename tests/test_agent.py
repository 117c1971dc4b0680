"""The agent stage (trainer/rl/agent.py, train_agent.py): the reward against gt by hand, tool answers that carry no
loss, no gradient and no old log-prob (a hand-built episode), multi-turn sampling log-probs against one forward over the
whole episode, the demo command offline, exact resume after a kill, bad input."""
import glob
import json
import os
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from dataset.rlaif_dataset import RLAIFDataset
from dataset.tools import TOOL_CASES, agent_rows, tool_schemas
from model.errors import ConfigError
from model.model_minimind import MiniMindForCausalLM
from tests.helpers.launch import TINY_MODEL, demo_slice, forked, kill_at_step, read_metrics, resume_run, spawn
from tests.helpers.serving import trained_ids
from trainer import train_agent
from trainer.core.batches import step_targets
from trainer.plan.resolve import resolve
from trainer.rl.agent import AgentObjective, AgentPlan, Episode, agent_reward, rule_agent
from trainer.rl.rewards import repetition_penalty
from trainer.rl.rows import scoring_log_probs, training_rows

TEMPERATURE = 0.8
CALL = '<tool_call>\n{"name": "calculate_math", "arguments": {"expression": "256*37"}}\n</tool_call>'
CASE = TOOL_CASES[0]  # 256 x 37 with calculate_math and get_current_time offered, gt 9472


# ----------------------------------------------------------------------------- the reward by hand
def test_the_agent_reward_by_hand():
    tools, gt = tool_schemas(CASE["tools"]), CASE["gt"]
    # a valid call, then the answer stating gt: +0.5 (one valid call for one gt value) +2.5 (gt stated), no repetition
    assert agent_reward([CALL, "256 times 37 is 9472."], gt, tools) == 3.0
    # a call without its required argument, then no gt: -0.5 x (|0 valid - 1 gt| + 1 invalid) = -1.0
    assert agent_reward(['<tool_call>\n{"name": "calculate_math", "arguments": {}}\n</tool_call>', "I do not know."],
                        gt, tools) == -1.0
    # no call: +0.5 length, think block of 13 characters (< 20): -0.5, one </think>: +0.25
    assert agent_reward(["<think>\nshort\n</think>\n\nThe answer is 9472."], gt, tools) == 0.25
    # an unclosed tag: -0.5 for the tags, +0.5 length, no call
    assert agent_reward(["<tool_call> oops"], gt, tools) == 0.0
    # three turns that all call: 3 valid calls for 1 gt value (-1.0), unfinished (-0.5, nothing stated), minus the
    # last turn's repetition penalty
    assert agent_reward([CALL] * 3, gt, tools) == pytest.approx(-1.5 - repetition_penalty(CALL))
    # the same as TRL-style reward function: conversational episodes, the rows' gt and tools columns
    episode = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": '{"result": "9472"}'},
               {"role": "assistant", "content": "256 times 37 is 9472."}]
    assert rule_agent([[]] * 2, [episode, [episode[0]]], gt=[gt, gt], tools=[tools, tools]) == [
        3.0, pytest.approx(0.5 - 0.5 - repetition_penalty(CALL))]


# ----------------------------------------------------------------------------- episodes in a real Trainer
def agent_flags(tmp_path, data, *extra):
    out = str(tmp_path / "out")
    return [*TINY_MODEL, "--data_path", data, "--from_weight", "none", "--max_seq_len", "448", "--max_gen_len", "8",
            "--max_total_len", "640", "--num_generations", "2", "--batch_size", "1", "--accumulation_steps", "1",
            "--temperature", str(TEMPERATURE), "--thinking_ratio", "0", "--save_dir", out, "--checkpoint_dir",
            os.path.join(out, "ckpt"), "--cache_dir", os.path.join(out, "c"), *extra]


def agent_trainer(monkeypatch, tmp_path, *extra):
    """A Trainer built as train_agent.py builds it (one process), its dataset of the nine TOOL_CASES rows."""
    os.makedirs(tmp_path, exist_ok=True)
    data = str(tmp_path / "agent.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in agent_rows())
    monkeypatch.setattr(sys, "argv", ["train_agent.py", *agent_flags(tmp_path, data, *extra)])
    return train_agent.build(train_agent.agent_args())


def observation(tokenizer, result):
    """The tool answer and the next (closed-think) generation prompt as the chat template writes them after <|im_end|>:
    written out here."""
    text = (f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n")
    return trained_ids(tokenizer, text)


def test_tool_answers_carry_no_loss_no_gradient_and_no_old_log_prob(monkeypatch, tmp_path):
    """A hand-built two-turn episode (the call, the mock's answer, a final turn) and its twin whose tool answered
    something else: the answer's tokens are context (labels -100, old log-probs 0), the loss's gradient at the
    positions that predict them is exactly 0 in both, and the first turn's gradient is the same in both (the answer
    comes after it)."""
    trainer, train_ds = agent_trainer(monkeypatch, tmp_path, "--beta", "0", "--num_iterations", "2",
                                      "--loss_type", "dapo")
    objective, tokenizer = trainer.objective, trainer.objective.tokenizer
    prompt_ids, length, row = train_ds[0]
    row = json.loads(row)
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    final = tokenizer("256 times 37 is 9472.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    episodes = []
    for result in ('{"result": "9472"}', '{"result": "-1", "note": "another answer"}'):
        episode = Episode(prompt_ids[-int(length):].tolist(), row["prompt"], row["tools"], open_thinking=False)
        episode.tokens = call + observation(tokenizer, result) + final
        episode.sampled = [True] * len(call) + [False] * (len(episode.tokens) - len(call) - len(final)) + \
            [True] * len(final)
        episodes.append(episode)
    # the real episode's answer is the one the agent's own turn-taking appends
    played = Episode(episodes[0].prompt, row["prompt"], row["tools"], open_thinking=False)
    objective.take_turn(played, call, [0.0] * len(call), cut=False, last=False)
    assert played.tokens == episodes[0].tokens[:len(played.tokens)] and not played.done
    input_ids, labels = training_rows([e.sequence for e in episodes], tokenizer.pad_token_id)
    targets = step_targets(labels)
    for i, episode in enumerate(episodes):  # labels: the sampled tokens where they stand, -100 elsewhere
        sampled = torch.tensor([False] * len(episode.prompt) + episode.sampled)
        assert torch.equal(labels[i, :len(sampled)] != -100, sampled) and (labels[i, len(sampled):] == -100).all()
    old = scoring_log_probs(trainer.model_parts, None, [(input_ids, labels)], trainer.plan, TEMPERATURE)[0]
    assert (old[targets == -100] == 0).all() and (old[targets != -100] != 0).all()
    logits = trainer.model_parts[0](input_ids).logits
    logits.retain_grad()
    row_stats = torch.zeros(2, len(objective.row_stat_names))
    extra = (torch.tensor([[1.0], [-0.5]]), row_stats, old)
    loss, _ = objective.policy_loss(logits, targets, extra, int((targets != -100).sum()))
    loss.backward()
    context = targets == -100  # positions that predict the prompt, the tool answer or padding
    assert (logits.grad[context] == 0).all() and (logits.grad[~context] != 0).any()
    first = slice(len(episodes[0].prompt) - 1, len(episodes[0].prompt) - 1 + len(call))  # predicting the call
    # the same prefix in another row: fp32 rounding of the row's other matmul results at most
    torch.testing.assert_close(logits.grad[0, first] / 1.0, logits.grad[1, first] / -0.5, rtol=1e-5, atol=1e-9)


class ScriptedTurn(torch.nn.Module):
    """The real model, its logits raised by 30 for the script's k-th token at position start + k: by position
    alone, so the KV-cache decoding and a full forward see the same model. The first turn writes the call."""

    def __init__(self, model, start, script):
        super().__init__()
        self.model, self.start, self.script = model, start, torch.tensor(script)

    def forward(self, input_ids, position_ids=None, **kwargs):
        out = self.model(input_ids, position_ids=position_ids, **kwargs)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape)
        k = position_ids[:, -out.logits.shape[1]:] - self.start
        rows, cols = ((k >= 0) & (k < len(self.script))).nonzero(as_tuple=True)
        out.logits[rows, cols, self.script[k[rows, cols]]] += 30.0
        return out


def test_multi_turn_sampling_log_probs_are_one_forward_over_the_episode(monkeypatch, tmp_path):
    """Two episodes of a prompt, each a forced tool call, the mock's answer, and a sampled second turn: every sampled
    token's log-prob (each turn sampled with the KV cache from its own context) equals log_softmax(logits / T) of one
    forward over the whole episode; the answer's tokens are the template's, written out, with log-prob 0."""
    trainer, train_ds = agent_trainer(monkeypatch, tmp_path, "--max_turns", "2", "--max_gen_len", "32")
    objective, tokenizer = trainer.objective, trainer.objective.tokenizer
    prompt_ids, length, row = train_ds[0]
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    model = ScriptedTurn(trainer.model_parts[0], int(length) - 1, call).eval()
    episodes = objective.episodes(SimpleNamespace(model_parts=[model]), 0, prompt_ids[None], length[None], [row], 0)
    answer = observation(tokenizer, '{"result": "9472"}')
    for episode in episodes:
        assert [m["role"] for m in episode.completion] == ["assistant", "tool", "assistant"]
        assert episode.tokens[:len(call) + len(answer)] == call + answer
        assert episode.sampled == [True] * len(call) + [False] * len(answer) + [True] * (
            len(episode.tokens) - len(call) - len(answer))
        context = torch.tensor(episode.context)
        with torch.no_grad():
            log_probs = torch.log_softmax(model(context[None]).logits[0].double() / TEMPERATURE, -1)
        sampled = torch.tensor([False] * len(episode.prompt) + episode.sampled)
        positions = sampled.nonzero()[:, 0]
        expected = log_probs[positions - 1].gather(1, context[positions, None])[:, 0]
        got = torch.tensor(episode.logprobs, dtype=torch.float64)[sampled[len(episode.prompt):]]
        # fp32 cached decoding against one fp32 forward: other matmul shapes, log-probs of size ~9: a few ulp
        assert torch.allclose(got, expected, atol=1e-5)
        assert all(lp == 0.0 for lp, s in zip(episode.logprobs, episode.sampled) if not s)
    assert episodes[0].tokens != episodes[1].tokens  # the second turns differ: each episode samples its own


def _zero3_episodes_worker(rank, world_size, out_dir, argv):
    """Under ZeRO-3 rank 0's episodes take two turns (a forced tool call), rank 1's one: each rank plays its own."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.data import apply_data_parallel
    from trainer.parallel.mesh import ParallelDims
    from trainer.rl.rollout import make_engine
    sys.argv = argv
    plan = resolve(train_agent.agent_args(), world_size, rank, AgentPlan)
    tokenizer = AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
    dataset = RLAIFDataset(plan.data.data_path, tokenizer, max_length=448, thinking_ratio=0.0)
    dims = ParallelDims.build(world_size)
    objective = AgentObjective(plan.stage, plan, dims, make_engine(plan, tokenizer, dims, nullcontext), tokenizer,
                               [rule_agent], [1.0])
    torch.manual_seed(0)
    model = apply_data_parallel(MiniMindForCausalLM(plan.model.config), init_device_mesh("cpu", (world_size,)),
                                zero_stage=3)
    prompt_ids, length, row = dataset[0]
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    policy = ScriptedTurn(model, int(length) - 1, call) if rank == 0 else model
    episodes = objective.episodes(SimpleNamespace(model_parts=[policy]), 0, prompt_ids[None], length[None], [row], 0)
    torch.save([[m["role"] for m in e.completion] for e in episodes], os.path.join(out_dir, f"rank{rank}.pt"))


def test_ranks_whose_episodes_end_sooner_keep_taking_turns_under_zero3(tmp_path):
    """FSDP2 gathers the weights for every rollout, a collective: a rank whose episodes are over still takes the
    turns another rank takes (with a throwaway row), so neither waits for the other."""
    data = str(tmp_path / "agent.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in agent_rows())
    argv = ["train_agent.py", *agent_flags(tmp_path, data, "--max_turns", "3", "--max_gen_len", "32",
                                           "--zero_stage", "3")]
    spawn(_zero3_episodes_worker, 2, str(tmp_path), argv, timeout=120, start_method="fork")
    roles = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert roles[0] == [["assistant", "tool", "assistant"]] * 2 and roles[1] == [["assistant"]] * 2


# ----------------------------------------------------------------------------- end to end
SCRIPT = "trainer/train_agent.py"
TIMING = ("tokens_per_sec", "mfu", "elapsed_s", "peak_mem_gb", "peak_mem_gb_per_rank", "rollout/tokens_per_sec",
          "rollout/time_share")


def run_flags(tmp_path, name, extra=()):
    """The demo command at small size (the embedded agent rows, the rule reward): 2 prompts x 2 episodes a step,
    each rollout trained twice."""
    out = str(tmp_path / name)
    return [*TINY_MODEL, "--from_weight", "none", "--max_seq_len", "448", "--max_gen_len", "8", "--max_total_len",
            "512", "--num_generations", "2", "--batch_size", "2", "--max_steps", "4", "--learning_rate", "1e-3",
            "--num_iterations", "2", "--save_interval", "1", "--save_dir", out, "--checkpoint_dir", f"{out}/ckpt",
            "--metrics_file", f"{out}/metrics.jsonl", *extra]


def test_the_demo_command_runs_offline_and_resumes_bitwise_after_a_kill(tmp_path):
    """The default data (the embedded agent_rl rows) on CPU; killed after step 3, between the two steps on one
    rollout, the resumed run's records equal the uninterrupted run's."""
    straight = run_flags(tmp_path, "straight")
    proc = forked(SCRIPT, straight)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = run_flags(tmp_path, "killed")
    kill_at_step("train_agent", run, 3)
    saved = {os.path.basename(os.path.dirname(path)) for path in
             glob.glob(os.path.join(run[run.index("--checkpoint_dir") + 1], "*", "step_*", "objective_0.pt"))}
    assert saved == {"step_1", "step_3"}  # the rollout the next step trains on again
    resume_run(SCRIPT, run, 3)
    got, expected = (read_metrics(argv[argv.index("--metrics_file") + 1]) for argv in (run, straight))
    assert [r["step"] for r in expected] == [1, 2, 3, 4] and "rewards/rule_agent/mean" in expected[0]
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # zip below compares every step, none left out
    for a, b in zip(got, expected):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_rows_offering_a_tool_the_mocks_lack_are_counted_in_one_line(monkeypatch, tmp_path, capsys):
    """A row whose tools include one dataset/tools.py cannot answer (search_web): the agent stage says how many rows
    offer such tools and names them before training."""
    rows = agent_rows()
    tools = json.loads(rows[0]["conversations"][0]["tools"])
    tools.append({"type": "function", "function": {"name": "search_web", "description": "Search the web.",
                                                   "parameters": {"type": "object", "properties": {}}}})
    rows[0]["conversations"][0]["tools"] = json.dumps(tools, ensure_ascii=False)
    data = str(tmp_path / "agent.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    monkeypatch.setattr(sys, "argv", ["train_agent.py", *agent_flags(tmp_path, data)])
    train_agent.build(train_agent.agent_args())
    out = capsys.readouterr().out
    assert (f"1 of 9 prompts of {data} offer tools the mock tools (dataset/tools.py) do not have (search_web): a call "
            "to one is answered with an error") in out, out


@pytest.mark.parametrize("flags,message", [
    (["--max_turns", "0"], "--max_turns must be at least 1 (got 0)"),
    (["--max_total_len", "400"], "--max_total_len 400 must exceed --max_seq_len 448"),
    (["--reward_weights", "1,1"], "--reward_weights has 2 values for 1 reward functions (the rule terms count 1: "
     "agent;"),
    (["--cp", "2"], "the agent stage does not run with --cp > 1"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, monkeypatch, flags, message):
    data = demo_slice(tmp_path, "agent", 10)
    monkeypatch.setattr(sys, "argv", ["train_agent.py", *agent_flags(tmp_path, data), *flags])
    with pytest.raises(ConfigError) as error:
        resolve(train_agent.agent_args(), 2, 0, AgentPlan)
    assert message in str(error.value), str(error.value)
