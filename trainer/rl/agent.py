"""Agent RL (MiniMind-3's train_agent.py): multi-turn tool episodes with MiniMind-3's mock tools, rewarded against the
row's ground truth, trained with GRPO's loss (trainer/rl/grpo.py).

An episode is one row of tokens: the prompt (the chat template with the row's tools), then the model's first turn as
sampled (up to its EOS), then, when that turn calls tools (dataset/tools.py parses the <tool_call> blocks), the mock
tools' answers as `tool` messages with the next turn's generation prompt, exactly as the chat template renders them
after the turn's EOS, then the model's next turn, sampled with the whole episode so far as its prompt: up to
--max_turns turns and --max_total_len tokens. The model's own tokens are the row's labels; the tool answers are
context, like the prompt: labels -100, so they carry no loss, no gradient and no old log-prob. A prompt's
num_generations episodes form its group; rewards are MiniMind's agent rule (`rule_agent`: the tool calls against the
gt's count, the gt values the final answer states, format terms), plus --reward_model / --reward_fn, which get the
episode as TRL's conversational completion (assistant and tool messages).
"""
import json
from dataclasses import dataclass, field

import torch

from dataset.prompt_ids import prompt_ids
from dataset.tools import MOCKS, gt_matches, parse_assistant, tool_message, valid_call
from model.errors import ConfigError
from trainer.base.errors import TrainingHalted
from trainer.base.launch import count_sum
from trainer.base.schema import Flag
from trainer.rl.base import check_positions, resolve_rollout
from trainer.rl.grpo import GRPOObjective, GRPOPlan, describe, resolve_group
from trainer.rl.rewards import THINK_END, answer_of, completion_texts, repetition_penalty
from trainer.rl.rollout import rollout_seed
from trainer.rl.rows import training_rows

REWARD_CLIP = 3.0  # MiniMind clips an episode's rule reward to [-3, 3]


# ----------------------------------------------------------------------------- the reward
def agent_reward(turns, gt, tools):
    """MiniMind's agent rule for one episode's turn texts: -0.5 per unbalanced <tool_call> tag; no call: the length,
    think and repetition terms of the last turn; calls: +0.5 when the valid calls number len(gt) and none is invalid
    (else -0.5 per call off), +2.5 x the share of gt values the final answer states, -0.5 when the last turn still
    calls a tool (unfinished), minus the final answer's repetition penalty. Clipped to [-3, 3]."""
    answers = [answer_of(text) for text in turns]
    reward = -0.5 * sum(abs(a.count("<tool_call>") - a.count("</tool_call>")) for a in answers)
    parsed = [parse_assistant(a) for a in answers]
    calls = [call for turn in parsed for call in turn.tool_calls]
    invalid = sum(len(turn.malformed) for turn in parsed)  # a <tool_call> block that is no call counts as a bad one
    response, answer = turns[-1], answers[-1]
    if not calls and not invalid:
        reward += 0.5 if 5 <= len(response.strip()) <= 800 else -0.5
        if THINK_END in response:
            thinking = response.split(THINK_END, 1)[0].strip()
            reward += 1.0 if 20 <= len(thinking) <= 300 else -0.5
            reward += 0.25 if response.count(THINK_END) == 1 else -0.25
        reward -= repetition_penalty(answer)
        return max(-REWARD_CLIP, min(REWARD_CLIP, reward))
    valid = sum(valid_call(call, tools) for call in calls)
    gap = abs(valid - len(gt)) + (len(calls) - valid) + invalid
    reward += 0.5 if gap == 0 else -0.5 * gap
    unfinished = bool(parsed[-1].tool_calls)
    final = "" if unfinished else answer.split("</tool_call>")[-1]
    if gt:
        reward += 2.5 * len(gt_matches(final, gt)) / len(gt)
    reward -= 0.5 * unfinished + repetition_penalty(final or answer)
    return max(-REWARD_CLIP, min(REWARD_CLIP, reward))


def rule_agent(prompts, completions, gt=None, tools=None, **columns):
    """The agent rule (agent_reward) in TRL's convention: each completion a conversational episode, `gt` and `tools`
    the rows' columns."""
    gt, tools = gt or [None] * len(completions), tools or [None] * len(completions)
    return [agent_reward([m["content"] for m in completion if m["role"] == "assistant"] if isinstance(completion, list)
                         else completion_texts([completion]), truth or [], offered or [])
            for completion, truth, offered in zip(completions, gt, tools)]


AGENT_RULES = (rule_agent,)


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class AgentPlan(GRPOPlan):
    """The agent stage's checked flags: GRPO's and the episode limits."""
    max_turns: int
    max_total_len: int
    name = "the agent stage"
    demo_kind = "agent"
    reward_rules = AGENT_RULES
    mock_tools = tuple(MOCKS)
    FLAGS = GRPOPlan.FLAGS + (  # MiniMind's defaults
        Flag("max_turns", int, 3, "model turns per episode (a turn that calls a tool gets the mock tool's answer and a "
             "next turn)", min=1),
        Flag("max_total_len", int, 2500, "tokens of a whole episode at most (prompt, turns, tool answers); a turn that "
             "would pass it is cut there"),
    )

    @classmethod
    def resolve(cls, args, plan):
        return resolve_agent(args, plan)

    def rollout_objective(self, *parts):
        return AgentObjective(self, *parts)

    def start_line(self, plan, objective):
        return describe_agent(plan, objective)

    @property
    def row_length(self):
        return self.max_total_len


def resolve_agent(args, plan):
    """Check the agent stage's flags against the TrainPlan; ConfigError (one line) on bad input."""
    group = resolve_group(args)
    if args.max_total_len <= args.max_seq_len:
        raise ConfigError(f"--max_total_len {args.max_total_len} must exceed --max_seq_len {args.max_seq_len} (the "
                          "prompt's tokens): the episode's turns and tool answers come after the prompt")
    stage = AgentPlan(**resolve_rollout(args, plan, "the agent stage", AGENT_RULES), **group,
                      max_turns=args.max_turns, max_total_len=args.max_total_len)
    check_positions(stage.max_total_len, plan, "--max_total_len")
    return stage


def describe_agent(plan, objective):
    stage = plan.stage
    return (describe(plan, objective, "Agent RL") + f"; episodes of up to {stage.max_turns} turns with the mock tools, "
            f"{stage.max_total_len} tokens at most")


# ----------------------------------------------------------------------------- episodes
@dataclass
class Episode:
    """One multi-turn completion of a prompt: its tokens after the prompt, which of them the model sampled, their
    sampling log-probs (0 on tool answers), and the turns and tool answers as messages."""
    prompt: list  # the prompt's token ids
    messages: list  # the prompt's messages and tools: the history the chat template renders
    tools: list
    open_thinking: bool  # the prompt opened the think block: every turn's generation prompt does
    tokens: list = field(default_factory=list)
    sampled: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    completion: list = field(default_factory=list)
    done: bool = False
    truncated: bool = False  # a turn was cut at --max_gen_len or --max_total_len

    @property
    def context(self):
        return self.prompt + self.tokens

    @property
    def sequence(self):
        """(token ids, scored flags) for training_rows: the model's own tokens scored, the prompt and the tool answers
        not."""
        return self.context, [False] * len(self.prompt) + self.sampled


def observation_text(tokenizer, episode, answers):
    """What the chat template puts after an assistant turn's EOS: the tool answers (`tool` messages) and the next
    turn's generation prompt."""
    history = episode.messages + episode.completion
    before = tokenizer.apply_chat_template(history, tools=episode.tools, tokenize=False)
    after = tokenizer.apply_chat_template(history + answers, tools=episode.tools, tokenize=False,
                                          add_generation_prompt=True, open_thinking=episode.open_thinking)
    eos = tokenizer.eos_token
    if not after.startswith(before) or eos not in before:
        raise TrainingHalted("the chat template renders an episode's history differently once tool answers follow "
                             "it; the agent stage needs a template whose turns end with the EOS token")
    return before[before.rindex(eos) + len(eos):] + after[len(before):]


def left_padded(contexts, pad_id):
    """(ids (N, W) left-padded, lengths (N,)) of token lists."""
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    for i, context in enumerate(contexts):
        ids[i, width - len(context):] = torch.tensor(context, dtype=torch.long)
    return ids, torch.tensor([len(c) for c in contexts])


class AgentObjective(GRPOObjective):
    """GRPO's loss on multi-turn tool episodes (see the module docstring)."""

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        super().__init__(stage, plan, dims, engine, tokenizer, functions, weights, reference)
        self.row_stat_names += ("turns_sum", "tool_calls_sum")
        self.stat_names += ("turns_sum", "tool_calls_sum")

    def micro_batch_rows(self, trainer, index, prompt_ids, prompt_lengths, data_rows, step):
        """One micro-batch's prompts played out num_generations times as episodes, scored, laid out as rows."""
        episodes = self.episodes(trainer, index, prompt_ids, prompt_lengths, data_rows, step)
        advantages, row_stats = self.score(
            trainer, [e.completion for e in episodes], torch.tensor([sum(e.sampled) for e in episodes]),
            torch.tensor([e.truncated for e in episodes]), data_rows, step)
        counts = torch.tensor([[sum(m["role"] == role for m in e.completion) for role in ("assistant", "tool")]
                               for e in episodes], dtype=torch.float32)
        rows = training_rows([e.sequence for e in episodes], self.tokenizer.pad_token_id, self.pipeline_row_length)
        return rows, advantages, torch.cat([row_stats, counts], dim=1)

    def episodes(self, trainer, index, prompt_ids, prompt_lengths, data_rows, step):
        """The episodes of one micro-batch's prompts, num_generations each (adjacent): turn by turn, every unfinished
        episode continues from its whole context, sampled with a seed of (seed, step, dp rank, micro-batch, turn).
        Every rank runs as many turns as the rank with the longest episode (a collective per turn)."""
        stage, pad_id = self.stage, self.tokenizer.pad_token_id
        width, episodes = prompt_ids.shape[1], []
        for ids, length, row in zip(prompt_ids.tolist(), prompt_lengths.tolist(), data_rows):
            row = json.loads(row)
            prompt = ids[width - length:]
            # the dataset rendered the prompt with the think block open or closed; the later turns' prompts follow it
            open_thinking = self.tokenizer.decode(prompt[-4:]).endswith("<think>\n")
            episodes += [Episode(prompt, row["prompt"], row.get("tools"), open_thinking)
                         for _ in range(stage.num_generations)]
        for turn in range(stage.max_turns):
            active = [e for e in episodes if not e.done]
            # every rank takes a turn while any rank has one: under ZeRO-2/3 each rollout gathers the weights (a
            # collective), so a rank whose episodes are over joins with a throwaway row
            if not count_sum(len(active)):
                break
            seed = rollout_seed(self.plan.data.seed, step, self.dims.rank("dp"), f"{index}:{turn}")
            if turn == 0:
                rollout = self.generate(trainer, prompt_ids, prompt_lengths, stage.num_generations, seed)
            else:
                contexts = [e.context for e in active] or [episodes[0].prompt]
                rollout = self.generate(trainer, *left_padded(contexts, pad_id), 1, seed)
            for row, episode in enumerate(active):
                n = int(rollout.completion_lengths[row])
                self.take_turn(episode, rollout.completion_ids[row, :n].tolist(), rollout.logprobs[row, :n].tolist(),
                               bool(rollout.truncated[row]), turn == stage.max_turns - 1)
        return episodes

    def take_turn(self, episode, ids, logprobs, cut, last):
        """Append one sampled turn (cut to the room --max_total_len leaves); unless it is the last, was cut or calls
        no tool, append the mock tools' answers and the next generation prompt, unscored."""
        room = self.stage.max_total_len - len(episode.context)
        if len(ids) > room:
            ids, logprobs, cut = ids[:room], logprobs[:room], True
        episode.tokens += ids
        episode.sampled += [True] * len(ids)
        episode.logprobs += logprobs
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.completion.append({"role": "assistant", "content": text})
        calls = parse_assistant(text, episode.open_thinking).tool_calls
        if cut or last or not calls:
            episode.done, episode.truncated = True, cut
            return
        answers = [tool_message(call, episode.tools) for call in calls]
        observation = prompt_ids(self.tokenizer, observation_text(self.tokenizer, episode, answers))
        if len(episode.context) + len(observation) >= self.stage.max_total_len:  # no room for the answers and a turn
            episode.done, episode.truncated = True, True
            return
        episode.tokens += observation
        episode.sampled += [False] * len(observation)
        episode.logprobs += [0.0] * len(observation)
        episode.completion += answers

    def record(self, stats, num_items):
        """GRPO's records, plus the mean model turns and tool calls per episode."""
        rows = max(stats["rows"], 1.0)
        return {**super().record(stats, num_items), "agent/turns": stats["turns_sum"] / rows,
                "agent/tool_calls": stats["tool_calls_sum"] / rows}
