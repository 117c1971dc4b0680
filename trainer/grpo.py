"""GRPO (Shao et al., DeepSeekMath; TRL's GRPOTrainer): the stage plan, its checks and the objective.

Each step, `prepare` turns this rank's prompts into a rollout (trainer/rollout.py: num_generations completions per
prompt, a prompt's group on one data-parallel rank), scores it (trainer/rewards.py), normalises the rewards within
each group into advantages, and hands train_step micro-batches of completion rows (trainer/rl_batch.py). The loss
of each completion token t of row i, with ratio r = pi(t) / pi_old(t) at the sampling temperature:
  grpo, dapo, dr_grpo, bnpo:  -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_t
  cispo:                      -sg(min(r, epsilon_high)) A_i log pi(t) + beta KL_t
KL_t = exp(ref - log pi) - (ref - log pi) - 1 (k3) against the frozen reference (the starting weights; none for
beta 0). Normalisers, TRL's: grpo the mean over completions of each one's token mean; bnpo the mean over
micro-batches of each one's token mean; dr_grpo the sum over rows / (rows x max_gen_len); dapo and cispo the sum
over the step's completion tokens / their number. pi_old: the policy that generated (with num_iterations 1 the
current one, detached: the ratio is exactly 1); a rollout is trained on num_iterations steps in a row, its old
log-probs taken by a forward of the policy before the first of them.
"""
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from trainer.launch import ConfigError, TrainingHalted
from trainer.metrics import step_flops
from trainer.objective import LMObjective, target_tokens
from trainer.policy_loss import clip_stats, k3_kl, normalised, token_entropy
from trainer.rewards import RULES, RewardModel, load_reward_fn, reward_name
from trainer.rl_batch import score_rollout, scoring_log_probs, tempered_log_probs, training_rows
from trainer.rollout import ENGINES, rollout_seed

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo")
TOKEN_LOSSES = ("dapo", "cispo")  # normalised by the step's completion tokens
CISPO_EPSILON_HIGH = 5.0  # MiniMind's --epsilon_high for cispo; the clipping losses default to --epsilon (TRL)
ROW_STATS = ("reward_sum", "reward_std_sum", "zero_std_sum", "length_sum", "truncated_sum")  # rl_batch's columns


@dataclass(frozen=True)
class GRPOPlan:
    """GRPO's checked flags."""
    num_generations: int
    beta: float
    loss_type: str
    epsilon: float
    epsilon_high: float
    num_iterations: int
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

    @property
    def rows_per_sample(self):
        """A prompt makes num_generations training rows (pipeline stage shapes)."""
        return self.num_generations

    @property
    def row_length(self):
        return self.max_prompt_len + self.max_gen_len


def resolve_grpo(args, plan):
    """Check GRPO's flags against the TrainPlan; ConfigError (one line) on bad input."""
    positive = dict(num_generations=args.num_generations, num_iterations=args.num_iterations,
                    max_gen_len=args.max_gen_len)
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {value})")
    for name in ("beta", "epsilon", "temperature", "rollout_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= 0 if name == "beta" else value > 0)):
            raise ConfigError(f"--{name} must be a {'non-negative' if name == 'beta' else 'positive'} number "
                              f"(got {value})")
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else (
        CISPO_EPSILON_HIGH if args.loss_type == "cispo" else args.epsilon)
    if not (math.isfinite(epsilon_high) and epsilon_high > 0):
        raise ConfigError(f"--epsilon_high must be a positive number (got {epsilon_high})")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must lie in (0, 1] (got {args.top_p})")
    if not 0 <= args.thinking_ratio <= 1:
        raise ConfigError(f"--thinking_ratio must lie in [0, 1] (got {args.thinking_ratio})")
    check_layout(args, plan)
    check_rewards(args)
    if args.max_seq_len + args.max_gen_len > plan.model_config.max_position_embeddings:
        raise ConfigError(f"--max_seq_len + --max_gen_len = {args.max_seq_len + args.max_gen_len} exceeds the "
                          f"model's {plan.model_config.max_position_embeddings} positions")
    return GRPOPlan(
        num_generations=args.num_generations, beta=float(args.beta), loss_type=args.loss_type,
        epsilon=float(args.epsilon), epsilon_high=float(epsilon_high), num_iterations=args.num_iterations,
        max_prompt_len=args.max_seq_len, max_gen_len=args.max_gen_len, temperature=float(args.temperature),
        top_p=float(args.top_p), thinking_ratio=float(args.thinking_ratio), rules=args.reward == "rule",
        reward_model=os.path.abspath(args.reward_model) if args.reward_model else None,
        reward_fns=tuple(args.reward_fn or ()), reward_weights=reward_weights(args),
        rollout_engine=args.rollout_engine, rollout_url=args.rollout_url, rollout_timeout=float(args.rollout_timeout),
        ref_weight=plan.from_weight)


def check_layout(args, plan):
    """Where generation and the loss can run: one line saying why not."""
    if plan.cp > 1:
        raise ConfigError("GRPO does not run with --cp > 1 (completions are short rows; use --tp or --pp)")
    if plan.sequence_parallel:
        raise ConfigError("--sequence_parallel 1: GRPO's rows vary in length; leave it out")
    if plan.packing:
        raise ConfigError("--packing 1: GRPO trains each completion in its own row; leave it out")
    if plan.eval_data_path:
        raise ConfigError("--eval_data_path: GRPO logs its rewards instead of a held-out LM loss; leave it out")
    if args.rollout_engine not in ENGINES:
        raise ConfigError(f"--rollout_engine must be one of {', '.join(ENGINES)} (got {args.rollout_engine})")
    if args.rollout_engine == "torch":
        if args.rollout_url:
            raise ConfigError("--rollout_url is for --rollout_engine sglang|vllm; the torch engine generates "
                              "in-process")
        if plan.tp > 1 or plan.pp > 1:
            raise ConfigError("--rollout_engine torch generates with the whole model on each rank, which --tp/--pp "
                              "split; use data parallel (--zero_stage 0-3), or --rollout_engine sglang|vllm "
                              "--rollout_url URL")
    elif not args.rollout_url:
        raise ConfigError(f"--rollout_engine {args.rollout_engine} needs --rollout_url (the server's base URL, "
                          "e.g. http://localhost:8998)")


def check_rewards(args):
    """At least one reward function; files exist; weights match their number."""
    if args.reward not in ("rule", "none"):
        raise ConfigError(f"--reward must be rule or none (got {args.reward})")
    if args.reward_model and not os.path.isdir(args.reward_model):
        raise ConfigError(f"--reward_model {args.reward_model} is not a folder (a Hugging Face "
                          "AutoModelForSequenceClassification)")
    count = len(RULES) * (args.reward == "rule") + bool(args.reward_model) + len(args.reward_fn or ())
    if count == 0:
        raise ConfigError("no reward: keep --reward rule, or pass --reward_model PATH or --reward_fn FILE.py:NAME")
    weights = reward_weights(args)
    if weights is not None and len(weights) != count:
        raise ConfigError(f"--reward_weights has {len(weights)} values for {count} reward functions (the rule terms "
                          "count 3: length, think, repetition; then the reward model, then each --reward_fn)")


def reward_weights(args):
    if args.reward_weights is None:
        return None
    try:
        return tuple(float(w) for w in args.reward_weights.split(","))
    except ValueError:
        raise ConfigError(f"--reward_weights must be a comma list of numbers (got {args.reward_weights})") from None


def reward_functions(stage, device):
    """The stage's reward functions (rules, reward model, user functions, in this order) and their weights."""
    functions = list(RULES) if stage.rules else []
    if stage.reward_model:
        functions.append(RewardModel(stage.reward_model, device))
    functions += [load_reward_fn(spec) for spec in stage.reward_fns]
    return functions, list(stage.reward_weights or [1.0] * len(functions))


def describe(plan, objective):
    """The run's line at start: start weights, groups, loss, reference, rewards, rollout engine."""
    stage = plan.stage
    rewards = ", ".join(f"{name} x{weight:g}" for name, weight in zip(objective.reward_names, objective.weights))
    engine = "in-process" if stage.rollout_engine == "torch" else f"{stage.rollout_engine} at {stage.rollout_url}"
    line = (f"GRPO from --from_weight {plan.from_weight}: {stage.num_generations} completions per prompt (up to "
            f"{stage.max_gen_len} tokens, temperature {stage.temperature}, top_p {stage.top_p}, {engine}), loss "
            f"{stage.loss_type} (epsilon {stage.epsilon}, epsilon_high {stage.epsilon_high}), beta {stage.beta}"
            f"{' (reference: the starting weights)' if stage.beta else ''}; rewards: {rewards}")
    if stage.num_iterations > 1:
        line += (f"; each rollout trains {stage.num_iterations} steps: the prompt batches drawn in the steps between "
                 f"are not generated from (an epoch uses 1 in {stage.num_iterations})")
    return line


def grpo_row_plan(plan):
    """The TrainPlan with GRPO's row length (prompt + completion) as its sequence length: the model's positions and
    the pipeline stages' shapes."""
    return replace(plan, seq_len=plan.stage.row_length)


class GRPOObjective(LMObjective):
    """The GRPO loss for train_step (see trainer/objective.py); `prepare` makes the step's rollout."""

    def __init__(self, stage, plan, dims, engine, tokenizer, functions, weights, reference=(None, None)):
        self.stage, self.plan, self.dims, self.engine, self.tokenizer = stage, plan, dims, engine, tokenizer
        self.functions, self.weights, self.reference = functions, weights, reference
        self.items_are_tokens = stage.loss_type in TOKEN_LOSSES
        self.reward_names = unique_names([reward_name(fn) for fn in functions])
        clip = ("cispo_clip_sum",) if stage.loss_type == "cispo" else ("clip_low_sum", "clip_high_sum",
                                                                       "clip_region_sum")
        self.stat_names = ("rows", "tokens", *ROW_STATS, *(f"rewards/{n}" for n in self.reward_names), "entropy_sum",
                           *clip, *(("kl_sum",) if stage.beta else ()))
        self.buffer, self.trained_positions = None, 0  # the rollout's micro-batches (reused num_iterations times)
        self.reused_next = False
        self.rollout_seconds = self.rollout_tokens = 0.0
        self.window_start = None

    # ------------------------------------------------------------------ the step's micro-batches
    def prepare(self, trainer, micro_batches):
        """Roll out this step's prompts (or reuse the last rollout within its num_iterations) into micro-batches
        (input_ids, labels, extra) of completion rows."""
        step = trainer.progress.global_step
        self.window_start = self.window_start or time.perf_counter()
        if self.buffer is None or step % self.stage.num_iterations == 0:
            self.buffer = self.roll_out(trainer, micro_batches, step)
        self.reused_next = (step + 1) % self.stage.num_iterations != 0  # the next step trains on this rollout too
        self.trained_positions = sum(ids.numel() for ids, _, _ in self.buffer)
        return self.buffer

    def roll_out(self, trainer, micro_batches, step):
        stage, plan = self.stage, self.plan
        self.engine.sync(trainer)
        rows, extras = [], []
        for index, (prompt_ids, prompt_lengths, data_rows) in enumerate(micro_batches):
            start = time.perf_counter()
            rollout = self.engine.generate(trainer.model_parts, prompt_ids.to(plan.device),
                                           prompt_lengths.to(plan.device), stage.num_generations,
                                           rollout_seed(plan.seed, step, self.dims.dp_rank, index))
            rollout = rollout.to("cpu")
            self.rollout_seconds += time.perf_counter() - start
            self.rollout_tokens += rollout.generated_tokens
            try:
                advantages, row_stats = score_rollout(rollout, data_rows, self.tokenizer, self.functions,
                                                      self.weights, stage.num_generations)
            except Exception as e:  # a user's reward function or reward model failed: name it, stop the run
                raise TrainingHalted(f"a reward function failed at step {step + 1}: {type(e).__name__}: {e}") from e
            rows.append(training_rows(rollout, self.tokenizer.pad_token_id, plan.seq_len if plan.pp > 1 else None))
            extras.append([advantages[:, None], row_stats])
        if stage.beta:
            for extra, values in zip(extras, scoring_log_probs(*self.reference, rows, plan, stage.temperature)):
                extra.append(values)
        if stage.num_iterations > 1:  # the generating policy's log-probs, for the ratio of the later iterations
            for extra, values in zip(extras, scoring_log_probs(trainer.model_parts, trainer.pipeline, rows, plan,
                                                               stage.temperature)):
                extra.append(values)
        return [(ids, labels, tuple(extra)) for (ids, labels), extra in zip(rows, extras)]

    def unpack(self, batch):
        input_ids, labels, extra = batch
        return input_ids, labels, None, extra

    def count(self, labels, extra):
        """This micro-batch's share of the step's normaliser: completion tokens (dapo, cispo), completions (grpo,
        dr_grpo) or one micro-batch (bnpo)."""
        loss_type = self.stage.loss_type
        return target_tokens(labels) if loss_type in TOKEN_LOSSES else 1 if loss_type == "bnpo" else labels.shape[0]

    # ------------------------------------------------------------------ the loss
    def loss(self, model, input_ids, targets, position_ids, extra, num_items):
        out = model(input_ids)
        main, stats = self.policy_loss(out.logits, targets, extra, num_items)
        return main, out.aux_loss, stats

    def pipeline_loss(self, logits, targets, extra, num_items):
        return self.policy_loss(logits, targets, extra, num_items)

    def policy_loss(self, logits, targets, extra, num_items):
        """(this micro-batch's share of the step's loss, stats) from the policy's logits (N, L, V)."""
        stage = self.stage
        advantages, row_stats = extra[0], extra[1]
        mask = (targets != -100).float()
        log_probs = tempered_log_probs(logits, targets, stage.temperature)
        old = extra[-1] if stage.num_iterations > 1 else log_probs.detach()
        ratio = torch.exp((log_probs - old) * mask)
        if stage.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=stage.epsilon_high).detach() * advantages * log_probs
        else:
            clipped = torch.clamp(ratio, 1 - stage.epsilon, 1 + stage.epsilon_high)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
        if stage.beta:
            kl = k3_kl(extra[2], log_probs)
            per_token = per_token + stage.beta * kl
        loss = normalised(per_token * mask, mask, stage.loss_type, num_items, stage.max_gen_len)
        stats = dict(rows=torch.tensor(float(mask.shape[0])), tokens=mask.sum().detach(),
                     entropy_sum=(token_entropy(logits, stage.temperature) * mask).sum())
        stats.update(zip(ROW_STATS + tuple(f"rewards/{n}" for n in self.reward_names), row_stats.sum(0)))
        stats.update(clip_stats(ratio.detach(), advantages, mask, stage))
        if stage.beta:
            stats["kl_sum"] = (kl.detach() * mask).sum()
        return loss, stats

    # ------------------------------------------------------------------ records
    def record(self, stats, num_items):
        """TRL's metric names, plus this process's rollout speed and its share of the wall time since the last
        record."""
        rows, tokens = max(stats["rows"], 1.0), max(stats["tokens"], 1.0)
        out = {"reward": stats["reward_sum"] / rows, "reward_std": stats["reward_std_sum"] / rows,
               "frac_reward_zero_std": stats["zero_std_sum"] / rows,
               **{f"rewards/{n}/mean": stats[f"rewards/{n}"] / rows for n in self.reward_names},
               "completions/mean_length": stats["length_sum"] / rows,
               "completions/clipped_ratio": stats["truncated_sum"] / rows, "entropy": stats["entropy_sum"] / tokens}
        if self.stage.beta:
            out["kl"] = stats["kl_sum"] / tokens
        if self.stage.loss_type == "cispo":
            out["cispo_clip_ratio"] = stats["cispo_clip_sum"] / tokens
        else:
            for side in ("low", "high", "region"):
                out[f"clip_ratio/{side}_mean"] = stats[f"clip_{side}_sum"] / tokens
        now = time.perf_counter()
        elapsed = now - (self.window_start or now)
        out["rollout/tokens_per_sec"] = self.rollout_tokens / self.rollout_seconds if self.rollout_seconds else 0.0
        out["rollout/time_share"] = self.rollout_seconds / elapsed if elapsed > 0 else 0.0
        self.rollout_seconds = self.rollout_tokens = 0.0
        self.window_start = now
        return out

    def flops(self, config, seq_len, positions, target_tokens, chunked_loss):
        """The policy's training FLOPs and the reference's forward (a third) on the rows as trained: the loop counts
        every row at the full row length, this rank's rows (as for the others) are as long as their completions;
        lm_head on every position."""
        rows = self.plan.micro_batch_shape[0] * self.plan.num_microbatches
        row_length = self.trained_positions / max(1, rows)
        train = step_flops(config, row_length, positions * row_length / seq_len, target_tokens, False)
        return train * (1 + (1 / 3 if self.stage.beta else 0))

    # ------------------------------------------------------------------ resume
    def state_dict(self):
        """The rollout the next step trains on again (num_iterations > 1), so a resume there trains on it too; {}
        (nothing saved) where the next step rolls out afresh."""
        return {"buffer": self.buffer} if self.reused_next else {}

    def load_state_dict(self, state):
        self.buffer = state.get("buffer")


def unique_names(names):
    """The reward functions' names for rewards/<name>/mean, a repeated one numbered (f, f_2, ...)."""
    return tuple(f"{name}_{names[:i].count(name) + 1}" if name in names[:i] else name for i, name in enumerate(names))
