"""Shared-prefix rows (trainer/core/shared_prefix.py): the layout by hand, and the per-token log-probs of every
sequence gathered back from the shared rows equal those of its own row, with their gradient."""
import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.core.batches import step_targets
from trainer.core.log_probs import target_positions, token_log_probs
from trainer.core.shared_prefix import share_prefixes, unshare

PAD = 0


def sequences(*pairs, length=16):
    """(input_ids, labels) (N, length) of (prompt, answer) token lists: the answer labelled, right-padded."""
    ids, labels = torch.full((len(pairs), length), PAD), torch.full((len(pairs), length), -100)
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def test_the_layout_by_hand():
    """A pair sharing a 3-token prompt, then a pair whose sequences differ from their second token: each branch
    starts at the last shared token, at its position; a branch from position 0 is a document of its own."""
    ids, labels = sequences(([5, 6, 7], [8, 9]), ([5, 6, 7], [10]), ([5, 11], [12]), ([5, 13, 14], [15, 16]))
    rows = share_prefixes(ids, labels, 2, PAD, multiple=4)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 10, 0], [5, 11, 12, 5, 13, 14, 15, 16]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4]]
    assert rows.labels.tolist() == [[-100, -100, -100, 8, 9, -100, 10, -100],
                                    [-100, -100, 12, -100, -100, -100, 15, 16]]
    # each sequence's targets (at the position before each labelled token) -> the flat index of the shared position
    assert rows.source[0, :5].tolist() == [-1, -1, 2, 3, -1] and rows.source[1, :4].tolist() == [-1, -1, 5, -1]
    assert rows.source[2, :3].tolist() == [-1, 9, -1] and rows.source[3, :5].tolist() == [-1, -1, 13, 14, -1]
    packed = share_prefixes(ids, labels, 2, PAD, capacity=16)  # both groups' documents in one row
    assert packed.input_ids.shape == (1, 15) and packed.position_ids[0, 7:].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("capacity", [0, 64])
def test_gathered_log_probs_and_gradients_equal_each_sequence_alone(capacity):
    """Groups of 3 completions of one prompt (GRPO) and pairs whose second answer shares less: the log-probs per token
    gathered from the shared rows (lm_head on the positions with a target) equal each sequence's own row's, and so do
    the gradients of a weighted sum of them; fewer positions run. Packed into one row (capacity 64), the second group's
    prompt lies between targets: the lm_head skips it (target_positions gives indices, not a span)."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=40, intermediate_size=64))
    ids, labels = sequences(([1, 2, 3, 4], [20, 21, 22]), ([1, 2, 3, 4], [23]), ([1, 2, 3, 4], [24, 25, 26, 27, 28]),
                            ([6, 7], [29, 30]), ([6, 8, 9], [31]), ([6, 7], [32, 33, 34]))
    weights = torch.randn(ids.shape)
    alone = token_log_probs(model(ids).logits, step_targets(labels))
    expected = torch.autograd.grad((alone * weights).sum(), list(model.parameters()))
    rows = share_prefixes(ids, labels, 3, PAD, multiple=8, capacity=capacity)
    targets = step_targets(rows.labels)
    keep = target_positions(targets)
    hits = (targets != -100).any(0).nonzero().flatten().tolist()
    if capacity:  # one row: the positions with a target, and only those
        assert rows.input_ids.shape[0] == 1 and keep.tolist() == hits and hits[-1] - hits[0] + 1 > len(hits)
    else:  # two rows whose targets cover one run of positions together
        assert keep == slice(hits[0], hits[-1] + 1)
    logits = model(rows.input_ids, position_ids=rows.position_ids, logits_to_keep=keep).logits
    shared = unshare(token_log_probs(logits, targets[:, keep]), rows.source, targets.shape[1], keep)
    got = torch.autograd.grad((shared * weights).sum(), list(model.parameters()))
    assert rows.input_ids.numel() < ids.numel()
    assert torch.equal(shared == 0, alone == 0)  # the same targets, none lost or added
    assert (shared - alone).abs().max().item() < 1e-5  # fp32: other kernels, the same sums in another order
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() <= 1e-5 * e.abs().max().item() + 1e-7
