"""Health lines: what a run's metric records say is wrong, each said once with what to try.

Pure functions over the records the loop logs (training records: "loss", "grad_norm", "skipped_steps", a stage's
fields; eval records: "eval_loss"), so scripts/report.py finds the same lines in a metrics JSONL afterwards; the
HealthWatch callback (trainer/observe/health_watch.py) runs them as the records come.
"""
import math
import statistics

STUCK_AFTER = 50  # steps after which a loss within STUCK_SHARE of ln(vocab) says nothing was learned
STUCK_SHARE = 0.05
SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_MIN = 3.0, 20, 5  # a loss above 3 x the median of the last 20 logged (5 at least)
GROWTH_RECORDS, GROWTH_FACTOR = 5, 10.0  # grad norm rising 5 logged steps in a row, to 10 x the run's median
SKIPPED_REPEATEDLY = 3  # non-finite steps skipped by the guard
DPO_AFTER, DPO_RECORDS, DPO_TOL = 20, 3, 1e-3  # loss within 1e-3 of ln 2 and |margin| < 1e-3 at 3 logged steps
RL_RECORDS, RL_FLAT, RL_GROWTH = 10, 0.05, 1.25  # reward moved < 5%, length grew >= 25% between the two halves
OVERFIT_EVALS = 3  # eval losses rising at 3 evals in a row while the train loss fell over the same steps
IDLE_RECORDS, IDLE_SHARE = 5, 0.02  # an expert with < 2% of the busiest expert's tokens at 5 logged steps in a row
REWARD_KEYS, LENGTH_KEYS = ("reward", "ppo/mean_scores"), ("completions/mean_length", "tokens/responses_len_mean")


def stuck_at_uniform(train, vocab_size):
    last = train[-1]
    if last["step"] >= STUCK_AFTER and abs(last["loss"] - math.log(vocab_size)) <= STUCK_SHARE * math.log(vocab_size):
        return (f"loss {last['loss']:.3f} is still about ln(vocab) = {math.log(vocab_size):.3f} after {last['step']} "
                "steps: the model predicts uniformly. Try a higher --learning_rate, check that the labels are not "
                "all -100 (the data notes at start), or that --from_weight loaded what you meant")


def spike(train, vocab_size):
    losses = [r["loss"] for r in train[-SPIKE_WINDOW - 1:-1] if math.isfinite(r["loss"])]
    last = train[-1]["loss"]
    if len(losses) >= SPIKE_MIN and math.isfinite(last) and last > SPIKE_FACTOR * statistics.median(losses) > 0:
        return (f"loss spike: {last:.3f} is {last / statistics.median(losses):.1f}x the median of the last "
                f"{len(losses)} logged losses. Try a lower --learning_rate or --warmup_steps 100, --grad_clip 1.0, or "
                "look for a bad batch near this step (the data notes at start)")


def grad_norm_growing(train, vocab_size):
    tail = [r.get("grad_norm", float("nan")) for r in train[-GROWTH_RECORDS:]]
    if len(tail) < GROWTH_RECORDS or not all(math.isfinite(n) for n in tail) or \
            not all(b > a for a, b in zip(tail, tail[1:])):
        return None  # checked first: the run's median below reads every record, so only when the tail rises
    finite = [n for r in train if math.isfinite(n := r.get("grad_norm", float("nan")))]
    if len(finite) > GROWTH_RECORDS and tail[-1] > GROWTH_FACTOR * statistics.median(finite):
        return (f"grad norm growing without bound: {tail[-1]:.3g}, up {GROWTH_RECORDS} logged steps in a row, "
                f"{tail[-1] / statistics.median(finite):.0f}x the run's median. Try a lower --learning_rate, "
                "--grad_clip 1.0, or --dtype bfloat16 instead of float16")


def skipped_repeatedly(train, vocab_size):
    skipped = train[-1].get("skipped_steps", 0)
    if skipped >= SKIPPED_REPEATEDLY:
        return (f"{skipped} steps skipped for a non-finite loss or gradient. Try a lower --learning_rate, "
                "--dtype bfloat16 or float32 instead of float16, or look for empty or broken rows in the data")


def dpo_stuck(train, vocab_size):
    tail = [r for r in train[-DPO_RECORDS:] if "rewards/margins" in r]
    if len(tail) == DPO_RECORDS and tail[-1]["step"] >= DPO_AFTER and all(
            abs(r["loss"] - math.log(2)) < DPO_TOL and abs(r["rewards/margins"]) < DPO_TOL for r in tail):
        return (f"DPO loss {tail[-1]['loss']:.4f} is ln 2 with a zero margin after {tail[-1]['step']} steps: the "
                "policy does not move from the reference. Try a higher --learning_rate or --beta, and check that "
                "chosen and rejected differ (the data notes at start)")


def rl_reward_flat(train, vocab_size):
    reward = next((k for k in REWARD_KEYS if k in train[-1]), None)
    length = next((k for k in LENGTH_KEYS if k in train[-1]), None)
    tail = train[-RL_RECORDS:]
    if reward is None or length is None or len(tail) < RL_RECORDS or any(reward not in r for r in tail):
        return None
    half = RL_RECORDS // 2
    r0, r1 = (statistics.mean(r[reward] for r in part) for part in (tail[:half], tail[half:]))
    n0, n1 = (statistics.mean(r[length] for r in part) for part in (tail[:half], tail[half:]))
    if abs(r1 - r0) <= RL_FLAT * max(abs(r0), 0.1) and n0 > 0 and n1 >= RL_GROWTH * n0:
        return (f"RL reward flat ({r0:.3f} -> {r1:.3f}) while the completions grow ({n0:.0f} -> {n1:.0f} tokens) "
                f"over the last {RL_RECORDS} logged steps: the policy pads its answers. Try a length penalty in the "
                "reward, a smaller --max_gen_len, or a higher --beta (KL to the reference)")


def overfitting(train, evals):
    if len(evals) <= OVERFIT_EVALS:
        return None
    tail = evals[-OVERFIT_EVALS - 1:]
    rising = all(b["eval_loss"] > a["eval_loss"] for a, b in zip(tail, tail[1:]))
    before = [r["loss"] for r in train if r["step"] <= tail[0]["step"]][-3:]
    after = [r["loss"] for r in train if tail[-2]["step"] < r["step"] <= tail[-1]["step"]]
    if rising and before and after and statistics.mean(after) < statistics.mean(before):
        return (f"eval loss rising {OVERFIT_EVALS} evals in a row ({tail[0]['eval_loss']:.3f} -> "
                f"{tail[-1]['eval_loss']:.3f}) while the train loss falls: the model memorises the training data. "
                "Keep the best checkpoint (--save_best 1, --early_stop_patience), train fewer epochs, or add data")


def idle_expert(train, vocab_size):
    tail = train[-IDLE_RECORDS:]
    layers = [k.split("/", 1)[1] for k in train[-1] if k.startswith("expert_tokens_min/")]
    for layer in layers:
        if len(tail) == IDLE_RECORDS and all(f"expert_tokens_min/{layer}" in r and r[f"expert_tokens_max/{layer}"] > 0
                                             and r[f"expert_tokens_min/{layer}"] < IDLE_SHARE *
                                             r[f"expert_tokens_max/{layer}"] for r in tail):
            return (f"an idle expert in {layer}: under {IDLE_SHARE:.0%} of the busiest expert's tokens at "
                    f"{IDLE_RECORDS} logged steps in a row. Try --router_balance bias or both (the aux loss alone "
                    "lets an expert starve)")


TRAIN_CHECKS = {"stuck": stuck_at_uniform, "spike": spike, "grad_norm": grad_norm_growing,
                "skipped": skipped_repeatedly, "dpo_stuck": dpo_stuck, "rl_flat": rl_reward_flat,
                "idle_expert": idle_expert}


class Health:
    """The records seen so far and the kinds already said; `add(record)` -> [(kind, step, line)] said new."""

    def __init__(self, vocab_size, keep=500):
        self.vocab_size, self.keep = vocab_size, keep
        self.train, self.evals, self.said = [], [], set()

    def add(self, record):
        if "eval_loss" in record:
            self.evals = (self.evals + [record])[-self.keep:]
            found = {"overfit": overfitting(self.train, self.evals)}
        elif "loss" in record:
            self.train = (self.train + [record])[-self.keep:]
            found = {kind: check(self.train, self.vocab_size) for kind, check in TRAIN_CHECKS.items()}
        else:
            return []  # benchmark scores, samples
        new = [(kind, record["step"], line) for kind, line in found.items() if line and kind not in self.said]
        self.said.update(kind for kind, _, _ in new)
        return new


def scan(records, vocab_size):
    """Every health line a stream of records shows, in order: [(kind, step, line)] (each kind once)."""
    health = Health(vocab_size)
    return [found for record in records for found in health.add(record)]
