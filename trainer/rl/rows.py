"""From a rollout to the training rows of an RL step: rewards, group advantages, rows, and the scoring forwards
(reference and old-policy log-probs at the sampling temperature) in the training layout.

A training row is one completion: its prompt's tokens, then the completion's (EOS included), then padding, so
positions run 0.. from the prompt's first token as in generation and the plain causal forward serves every layout.
Labels are the completion's tokens at their positions (-100 elsewhere): the prompt, the padding and anything after
EOS are never scored. Under pipeline parallelism every row is padded to the plan's row length (the stages' fixed
shapes); otherwise to the longest row of its micro-batch.
"""
import json

import torch

from trainer.core.batches import autocast, step_targets
from trainer.core.log_probs import target_positions, token_log_probs
from trainer.core.shared_prefix import unshare
from trainer.parallel.tensor import tp_loss_context
from trainer.rl.policy_loss import group_advantages
from trainer.rl.rewards import score


def training_rows(sequences, pad_id, length=None):
    """(input_ids, labels) (N, length) of (token ids, scored flags) pairs, one per row: the ids right-padded, labels
    the scored tokens where they stand (a completion's, an episode's sampled turns), -100 elsewhere (the prompt, tool
    answers, padding). length None: the longest row."""
    length = length or max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    for i, (ids, scored) in enumerate(sequences):
        ids = torch.as_tensor(ids, dtype=torch.long)
        input_ids[i, :len(ids)] = ids
        labels[i, :len(ids)] = torch.where(torch.as_tensor(scored, dtype=torch.bool), ids, -100)
    return input_ids, labels


def rollout_sequences(rollout):
    """Each completion after its prompt's tokens (left padding dropped), the completion's tokens (EOS included)
    scored: training_rows' input."""
    width = rollout.prompt_ids.shape[1]
    return [(torch.cat([rollout.prompt_ids[i, width - p:], rollout.completion_ids[i, :c]]), [False] * p + [True] * c)
            for i, (p, c) in enumerate(zip(rollout.prompt_lengths.tolist(), rollout.completion_lengths.tolist()))]


def decode_completions(tokenizer, rollout):
    """Each completion's text (special tokens dropped, as MiniMind), in TRL's conversational form."""
    texts = tokenizer.batch_decode([ids[:n] for ids, n in zip(rollout.completion_ids.tolist(),
                                                              rollout.completion_lengths.tolist())],
                                   skip_special_tokens=True)
    return [[{"role": "assistant", "content": text}] for text in texts]


def reward_columns(rows, num_generations):
    """(prompts, columns) for the reward functions from the dataset rows (JSON), each repeated per completion."""
    parsed = [json.loads(row) for row in rows for _ in range(num_generations)]
    prompts = [row.pop("prompt") for row in parsed]
    names = sorted({name for row in parsed for name in row})
    return prompts, {name: [row.get(name) for row in parsed] for name in names}


def score_completions(completions, lengths, truncated, rows, functions, weights, num_generations,
                      advantages_of=group_advantages):
    """(advantages (N,), row stats (N, 5 + F)) of scored completions (TRL's conversational form, a prompt's
    num_generations adjacent): per row reward, group std, zero-std flag, length, truncated flag, then each reward
    function's value (the record's reward, reward_std, frac_reward_zero_std, completions/*, rewards/<fn>/mean).
    advantages_of: the loss variant's estimator (trainer/rl/policy_loss.py)."""
    prompts, columns = reward_columns(rows, num_generations)
    rewards, per_function = score(functions, weights, prompts, completions, columns)
    advantages, std = advantages_of(rewards, num_generations)
    stats = torch.stack([rewards, std, (std == 0).float(), lengths.float(), truncated.float()], dim=1)
    return advantages, torch.cat([stats, per_function], dim=1)


def tempered_log_probs(logits, targets, temperature):
    """(N, L) log-probs of the targets under softmax(logits / temperature), 0 where there is none."""
    return token_log_probs(logits / temperature, targets)


def scoring_log_probs(model_parts, pipeline, micro_batches, plan, temperature, share=None):
    """Per micro-batch (N, L) target log-probs at `temperature` under a model in the training layout (the reference,
    or the policy before its update); `share`: the objective's shared rows of a micro-batch, as its loss runs them."""
    return scoring_forward(model_parts, pipeline, micro_batches, plan,
                           lambda logits, targets: tempered_log_probs(logits, targets, temperature), share=share)


@torch.no_grad()
def scoring_forward(model_parts, pipeline, micro_batches, plan, score, columns=1, share=None):
    """Per micro-batch `score(logits, targets)` (N, L), or (N, L, columns), of a no-grad forward in the training
    layout: one forward per micro-batch (share(input_ids, labels): of its shared rows, trainer/core/shared_prefix.py,
    the values gathered back to each row's positions), or the pipeline's forward-only schedule over all of them
    (zeros off its last stage, whose values are never read)."""
    targets = [step_targets(labels) for _, labels in micro_batches]
    if pipeline is None:
        model, out, device = model_parts[0], [], plan.layout.device
        for (input_ids, labels), t in zip(micro_batches, targets):
            with tp_loss_context(plan.layout.tp > 1), autocast(plan):  # vocab-sharded logits under tensor parallel
                if share is None:
                    out.append(score(model(input_ids.to(device)).logits, t.to(device)).cpu())
                    continue
                rows = share(input_ids, labels)
                shared_targets = step_targets(rows.labels).to(device)
                keep = target_positions(shared_targets)  # as the loss runs its lm_head
                logits = model(rows.input_ids.to(device), position_ids=rows.position_ids.to(device),
                               logits_to_keep=keep).logits
                values = score(logits, shared_targets[:, keep])
                out.append(unshare(values, rows.source.to(device), shared_targets.shape[1], keep).cpu())
        return out
    input_ids = torch.cat([ids for ids, _ in micro_batches]).to(plan.layout.device)
    values = pipeline.forward_only(input_ids, torch.cat(targets).to(plan.layout.device), score)
    if values is None:
        return [torch.zeros(t.shape + ((columns,) if columns > 1 else ())) for t in targets]
    return list(values.cpu().split([t.shape[0] for t in targets]))
