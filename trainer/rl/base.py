"""What the RL stages (GRPO, PPO, agent) share: RolloutPlan (the rollout and reward flags' checks and plan fields,
the prompts, and the objective's parts: reward functions, reference, rollout engine), and RolloutObjective, the base
of their objectives.

A RolloutObjective's `prepare` hook (trainer/plan/objective.py) turns the step's prompts into training rows: each
micro-batch's prompts are completed by the rollout engine (trainer/rl/rollout.py) on the current policy, the completions
scored by the reward functions (trainer/rl/rewards.py), and laid out as rows of prompt + completion tokens
(trainer/rl/rows.py). It times the generation, for the log's rollout/tokens_per_sec and rollout/time_share.
"""
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from transformers import AutoTokenizer

from dataset.rlaif_dataset import RLAIFDataset
from model.errors import ConfigError
from trainer.base.errors import TrainingHalted
from trainer.base.log import Logger
from trainer.base.schema import Flag
from trainer.ckpt.step_dirs import latest_checkpoint
from trainer.ckpt.weights_file import save_last_completed
from trainer.core.batches import autocast
from trainer.plan.objective import LMObjective
from trainer.plan.stage import Stage
from trainer.rl.policy_loss import group_advantages
from trainer.rl.rewards import RULES, RewardFailed, RewardModel, check_reward_model, load_reward_fn, reward_name
from trainer.rl.rollout import ENGINES, make_engine, rollout_seed
from trainer.rl.rows import decode_completions, rollout_sequences, score_completions, training_rows
from trainer.stages.dpo_reference import load_reference

ROW_STATS = ("reward_sum", "reward_std_sum", "zero_std_sum", "length_sum", "truncated_sum")  # score_completions'


@dataclass(frozen=True)
class RolloutPlan(Stage):
    """The checked flags every RL stage has: generation, rewards, the rollout engine and the reference. A subclass
    gives num_generations, uses_reference, rollout_objective and start_line (trainer/plan/stage.py for the rest)."""
    max_prompt_len: int
    max_gen_len: int
    temperature: float
    top_p: float
    thinking_ratio: float
    rules: bool  # --reward rule
    reward_model: Optional[str]
    reward_fns: tuple  # FILE.py:NAME specs
    reward_weights: Optional[tuple]
    rollout_engine: str
    rollout_url: Optional[str]
    rollout_timeout: float
    ref_weight: str  # the reference model: the starting weights (--from_weight)
    demo_kind = "rlaif"
    has_eval = False  # it logs its rewards
    padded_rows = False  # its samples are prompts; its training rows are as long as their micro-batch's longest already
    reward_rules = RULES  # the rule functions of --reward rule
    mock_tools = None  # the names of the tools episodes can call (the agent stage's)
    FLAGS = (  # MiniMind's defaults
        Flag("max_gen_len", int, 1024, "tokens generated at most per completion (agent: per turn)", min=1),
        Flag("temperature", float, 0.8, "sampling temperature; the log-probs are taken at it too"),
        Flag("top_p", float, 1.0, "nucleus sampling mass (1: the whole vocabulary)"),
        Flag("thinking_ratio", float, 0.9, "share of prompts that open the think block"),
        Flag("reward", str, "rule", "rule: MiniMind's rule terms (GRPO, PPO: length, think format, repetition; agent: "
             "the tool-call rule against the row's gt), offline", choices=("rule", "none")),
        Flag("reward_model", str, None, "a local Hugging Face AutoModelForSequenceClassification folder (its first "
             "logit is a reward; trainer/train_reward.py writes out/reward_<hidden>_hf)"),
        Flag("reward_fn", str, None, "FILE.py:NAME, a reward function NAME(prompts, completions, **columns) -> "
             "list[float] (TRL's convention); repeat for several", action="append"),
        Flag("reward_weights", str, None, "comma list, one weight per reward function in the order: rule terms (GRPO, "
             "PPO: 3; agent: 1), reward model, each --reward_fn (default: 1 each)"),
        Flag("rollout_engine", str, "torch", "torch: generate in-process; sglang|vllm: an OpenAI-compatible server at "
             "--rollout_url, synced through an HF export folder", choices=("torch", "sglang", "vllm")),
        Flag("rollout_url", str, None, "the rollout server's base URL (--rollout_engine sglang|vllm)"),
        Flag("rollout_timeout", float, 600, "seconds a rollout server request may take"),
    )

    def sequence_length(self, max_seq_len):
        """Training rows hold prompt and completion (--max_seq_len is the prompt's length)."""
        return self.row_length

    def dataset(self, plan, tokenizer, path):
        """The prompts (RLAIFDataset), the think block opened for --thinking_ratio of them."""
        return RLAIFDataset(path, tokenizer, max_length=self.max_prompt_len, thinking_ratio=self.thinking_ratio,
                            seed=plan.data.seed, skip_bad_lines=plan.data.skip_bad_lines, mock_tools=self.mock_tools)

    def objective(self, plan, dims, train_ds):
        """The stage's rollout objective with its reward functions, the frozen reference (the starting weights; none
        without a KL term) and the rollout engine; its line at start."""
        tokenizer = AutoTokenizer.from_pretrained(plan.data.tokenizer_path)
        functions, weights = reward_functions(self, plan.layout.device, self.reward_rules)
        reference = load_reference(plan, dims) if self.uses_reference else (None, None)
        engine = make_engine(plan, tokenizer, dims, lambda: autocast(plan))
        objective = self.rollout_objective(plan, dims, engine, tokenizer, functions, weights, reference)
        Logger(self.start_line(plan, objective))
        return objective

    @property
    def rows_per_sample(self):
        """A prompt makes num_generations training rows (pipeline stage shapes)."""
        return self.num_generations

    @property
    def row_length(self):
        """The longest training row: prompt and completion."""
        return self.max_prompt_len + self.max_gen_len


def resolve_rollout(args, plan, stage_name, rules=RULES):
    """The checked RolloutPlan fields (a dict) of the shared flags; ConfigError (one line) on bad input."""
    for name in ("temperature", "rollout_timeout"):  # plain checks, as trainer/plan/checks.py check_numbers
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ConfigError(f"--{name} must be a positive number (got {getattr(args, name)})")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must lie in (0, 1] (got {args.top_p})")
    if not 0 <= args.thinking_ratio <= 1:
        raise ConfigError(f"--thinking_ratio must lie in [0, 1] (got {args.thinking_ratio})")
    check_layout(args, plan, stage_name)
    check_rewards(args, rules)
    return dict(
        max_prompt_len=args.max_seq_len, max_gen_len=args.max_gen_len, temperature=float(args.temperature),
        top_p=float(args.top_p), thinking_ratio=float(args.thinking_ratio), rules=args.reward == "rule",
        reward_model=os.path.abspath(args.reward_model) if args.reward_model else None,
        reward_fns=tuple(args.reward_fn or ()), reward_weights=reward_weights(args),
        rollout_engine=args.rollout_engine, rollout_url=args.rollout_url, rollout_timeout=float(args.rollout_timeout),
        ref_weight=plan.model.from_weight)


def check_positions(length, plan, flags):
    """The longest row fits the model's positions."""
    if length > plan.model.config.max_position_embeddings:
        raise ConfigError(f"{flags} = {length} exceeds the model's {plan.model.config.max_position_embeddings} "
                          "positions")


def check_layout(args, plan, stage_name):
    """Where generation and the loss can run: one line saying why not."""
    if plan.layout.cp > 1:
        raise ConfigError(f"{stage_name} does not run with --cp > 1 (completions are short rows; use --tp or --pp)")
    if plan.layout.sequence_parallel:
        raise ConfigError(f"--sequence_parallel 1: {stage_name}'s rows vary in length; leave it out")
    if plan.data.packing:
        raise ConfigError(f"--packing 1: {stage_name} trains each completion in its own row; leave it out")
    if args.rollout_engine not in ENGINES:
        raise ConfigError(f"--rollout_engine must be one of {', '.join(ENGINES)} (got {args.rollout_engine})")
    if args.rollout_engine == "torch":
        if args.rollout_url:
            raise ConfigError("--rollout_url is for --rollout_engine sglang|vllm; the torch engine generates "
                              "in-process")
        if plan.layout.tp > 1 or plan.layout.pp > 1:
            raise ConfigError("--rollout_engine torch generates with the whole model on each rank, which --tp/--pp "
                              "split; use data parallel (--zero_stage 0-3), or --rollout_engine sglang|vllm "
                              "--rollout_url URL")
    elif not args.rollout_url:
        raise ConfigError(f"--rollout_engine {args.rollout_engine} needs --rollout_url (the server's base URL, "
                          "e.g. http://localhost:8998)")


def check_rewards(args, rules=RULES):
    """At least one reward function; files exist; weights match their number."""
    if args.reward not in ("rule", "none"):
        raise ConfigError(f"--reward must be rule or none (got {args.reward})")
    if args.reward_model:
        check_reward_model(args.reward_model)
    count = len(rules) * (args.reward == "rule") + bool(args.reward_model) + len(args.reward_fn or ())
    if count == 0:
        raise ConfigError("no reward: keep --reward rule, or pass --reward_model PATH or --reward_fn FILE.py:NAME")
    weights = reward_weights(args)
    if weights is not None and len(weights) != count:
        terms = ", ".join(fn.__name__.removeprefix("rule_") for fn in rules)
        raise ConfigError(f"--reward_weights has {len(weights)} values for {count} reward functions (the rule terms "
                          f"count {len(rules)}: {terms}; then the reward model, then each --reward_fn)")


def reward_weights(args):
    if args.reward_weights is None:
        return None
    try:
        return tuple(float(w) for w in args.reward_weights.split(","))
    except ValueError:
        raise ConfigError(f"--reward_weights must be a comma list of numbers (got {args.reward_weights})") from None


def reward_functions(stage, device, rules=RULES):
    """The stage's reward functions (rules, reward model, user functions, in this order) and their weights."""
    functions = list(rules) if stage.rules else []
    if stage.reward_model:
        functions.append(RewardModel(stage.reward_model, device))
    functions += [load_reward_fn(spec) for spec in stage.reward_fns]
    return functions, list(stage.reward_weights or [1.0] * len(functions))


def rewards_line(objective):
    """'name xweight, ...' of the stage's reward functions, for its start line."""
    return ", ".join(f"{name} x{weight:g}" for name, weight in zip(objective.reward_names, objective.weights))


def engine_line(stage):
    return "in-process" if stage.rollout_engine == "torch" else f"{stage.rollout_engine} at {stage.rollout_url}"


def unique_names(names):
    """The reward functions' names for rewards/<name>/mean, a repeated one numbered (f, f_2, ...)."""
    return tuple(f"{name}_{names[:i].count(name) + 1}" if name in names[:i] else name for i, name in enumerate(names))


def save_completed_step(trainer):
    """Save the last completed step as a preempted run saves it (trainer/runtime/signals.py save_abandoned: its
    parameters, optimizer state, progress and the RNG state it ended with are untouched by the step in progress) and
    say where; several ranks cannot save without the others (collectives): they name the last complete checkpoint."""
    plan = trainer.plan
    step = save_last_completed(trainer) if plan.layout.world_size == 1 else 0
    if step == 0:
        last = latest_checkpoint(plan.io.run_dir)
        return (f"the last complete checkpoint is {last}, continue with --from_resume 1" if last else
                "no checkpoint saved yet")
    return f"step {step} saved in {plan.io.run_dir}; continue with --from_resume 1"


class RolloutObjective(LMObjective):
    """The base of the RL objectives: the step's prompts -> completions -> rewards -> training rows, timed.

    Subclasses give the loss (`loss`, `pipeline_loss`, `record`) and call `roll_out_rows` from `prepare`. Training
    rows come as (input_ids, labels, extra) micro-batches; extra holds per-row tensors (advantages, row stats, ...)
    that ride with the rows to the loss, on the last pipeline stage too."""

    reuses_rollouts = True  # a step that generates nothing trains on the last rollout again

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        self.stage, self.plan, self.dims, self.engine, self.tokenizer = stage, plan, dims, engine, tokenizer
        self.functions, self.weights, self.reference = functions, weights, reference
        self.reward_names = unique_names([reward_name(fn) for fn in functions])
        self.buffer, self.trained_positions, self.reused_next = None, 0, False  # the rollout's micro-batches
        self.rollout_seconds = self.rollout_tokens = 0.0
        self.rollouts = 0  # engine calls since the last record
        self.window_start = None
        self.advantages_of = group_advantages  # the loss variant's advantage estimator (GRPO's: per group)

    def unpack(self, batch):
        input_ids, labels, extra = batch
        return input_ids, labels, None, extra

    def roll_out_rows(self, trainer, micro_batches, step):
        """[((input_ids, labels), advantages (N,), row stats (N, 5 + F))] of this step's micro-batches of prompts."""
        self.window_start = self.window_start or time.perf_counter()
        self.engine.sync(trainer)
        return [self.micro_batch_rows(trainer, index, prompt_ids, prompt_lengths, rows, step)
                for index, (prompt_ids, prompt_lengths, rows) in enumerate(micro_batches)]

    def micro_batch_rows(self, trainer, index, prompt_ids, prompt_lengths, data_rows, step):
        """One micro-batch's prompts completed num_generations times, scored, laid out as rows."""
        rollout = self.generate(trainer, prompt_ids, prompt_lengths, self.stage.num_generations,
                                rollout_seed(self.plan.data.seed, step, self.dims.rank("dp"), index))
        advantages, row_stats = self.score(trainer, decode_completions(self.tokenizer, rollout),
                                           rollout.completion_lengths, rollout.truncated, data_rows, step)
        rows = training_rows(rollout_sequences(rollout), self.tokenizer.pad_token_id, self.pipeline_row_length)
        return rows, advantages, row_stats

    @property
    def pipeline_row_length(self):
        """Rows are padded to the plan's row length under pp (fixed stage shapes), else to their micro-batch's
        longest."""
        return self.plan.data.seq_len if self.plan.layout.pp > 1 else None

    def generate(self, trainer, prompt_ids, prompt_lengths, num_generations, seed):
        """The engine's Rollout (on the CPU) of left-padded prompts; its time and tokens counted for the log."""
        start = time.perf_counter()
        rollout = self.engine.generate(trainer.model_parts, prompt_ids.to(self.plan.layout.device),
                                       prompt_lengths.to(self.plan.layout.device), num_generations, seed).to("cpu")
        self.rollout_seconds += time.perf_counter() - start
        self.rollout_tokens += rollout.generated_tokens
        self.rollouts += 1
        return rollout

    def score(self, trainer, completions, lengths, truncated, data_rows, step):
        """(group advantages, row stats) of scored completions; a failing reward function stops the run in one line
        naming it, the last completed step saved first."""
        try:
            return score_completions(completions, lengths, truncated, data_rows, self.functions, self.weights,
                                     self.stage.num_generations, self.advantages_of)
        except RewardFailed as e:
            raise TrainingHalted(f"step {step + 1}: {e}; {save_completed_step(trainer)}") from e

    def row_record(self, stats):
        """TRL's reward and completion records from the row stats summed over the step."""
        rows = max(stats["rows"], 1.0)
        return {"reward": stats["reward_sum"] / rows, "reward_std": stats["reward_std_sum"] / rows,
                "frac_reward_zero_std": stats["zero_std_sum"] / rows,
                **{f"rewards/{n}/mean": stats[f"rewards/{n}"] / rows for n in self.reward_names},
                "completions/mean_length": stats["length_sum"] / rows,
                "completions/clipped_ratio": stats["truncated_sum"] / rows}

    def rollout_record(self):
        """This process's rollout speed and its share of the wall time since the last record; rollout/reused where
        the objective trains on a rollout again (GRPO, PPO, agent): true when the steps since the last record
        generated nothing, so trained on an earlier step's rollout."""
        now = time.perf_counter()
        elapsed = now - (self.window_start or now)
        out = {"rollout/tokens_per_sec": self.rollout_tokens / self.rollout_seconds if self.rollout_seconds else 0.0,
               "rollout/time_share": self.rollout_seconds / elapsed if elapsed > 0 else 0.0}
        if self.reuses_rollouts:
            out["rollout/reused"] = self.rollouts == 0
        self.rollout_seconds = self.rollout_tokens = 0.0
        self.rollouts = 0
        self.window_start = now
        return out

    # ------------------------------------------------------------------ resume
    def state_dict(self):
        """The rollout the next step trains on again, so a resume there trains on it too; {} (nothing saved) where the
        next step rolls out afresh."""
        return {"buffer": self.buffer} if self.reused_next else {}

    def load_state_dict(self, state):
        self.buffer = state.get("buffer")
