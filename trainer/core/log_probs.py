"""Log-probs of the targets: per token and summed per row, in fp32 chunks of rows (DPO's sums, the RL stages'
per-token log-probs at a temperature), and log_softmax for whole distributions (distillation, the RL entropy);
vocab-sharded logits (tensor parallel) through loss_parallel's cross-entropy.
"""
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

LOG_PROB_CHUNK = 1024  # rows of logits turned into fp32 log-softmax at a time


class _TargetLogProbs(torch.autograd.Function):
    """log softmax(logits)[target] per row, in fp32 chunks of rows; backward recomputes each chunk's softmax.

    Only the logits (the model's output, in its dtype) are kept for backward, never a full fp32 copy of them.
    """

    @staticmethod
    def forward(ctx, logits, targets, chunk_size):
        out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        valid = targets != -100
        safe = torch.where(valid, targets, 0)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
            out[rows] = log_probs.gather(1, safe[rows, None]).squeeze(1)
        out = out * valid
        ctx.save_for_backward(logits, safe, valid)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, safe, valid = ctx.saved_tensors
        grad = torch.empty_like(logits)
        weights = (grad_out * valid).float()
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            w = weights[rows, None]
            chunk = torch.softmax(logits[rows].float(), dim=-1).mul_(-w)  # d log p_t / d z = onehot(t) - softmax
            chunk.scatter_add_(1, safe[rows, None], w)
            grad[rows] = chunk.to(logits.dtype)
        return grad, None, None


def token_log_probs(logits, targets, chunk_size=LOG_PROB_CHUNK):
    """Log-prob of each target (0 where -100): logits (N, L, V), targets (N, L) -> (N, L) fp32.

    Vocab-sharded DTensor logits (tensor parallel, under loss_parallel()) go through cross_entropy with
    reduction="none", which loss_parallel supports: log p = -CE.
    """
    rows, length = targets.shape
    if hasattr(logits, "placements"):
        per_token = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                     reduction="none")
        per_token = per_token.full_tensor() if hasattr(per_token, "full_tensor") else per_token
    else:
        per_token = _TargetLogProbs.apply(logits.flatten(0, 1), targets.flatten(), chunk_size)
    return per_token.view(rows, length)


def sequence_log_probs(logits, targets, chunk_size=LOG_PROB_CHUNK):
    """Summed log-probs of each row's targets (-100: none): logits (N, L, V), targets (N, L) -> (N,) fp32."""
    return token_log_probs(logits, targets, chunk_size).sum(dim=1)


def target_positions(targets):
    """The positions the lm_head runs on, for the model's logits_to_keep: those where some row has a target (a
    prompt's positions have none). A slice where they are one run, else their indices (LongTensor): packed rows skip
    the prompts between their documents. On CPU targets only, whose positions cost no sync; a CUDA step keeps every
    position (slice(None))."""
    if targets.device.type != "cpu" or hasattr(targets, "placements"):
        return slice(None)
    hits = (targets != -100).any(0).nonzero().flatten()
    if not len(hits):
        return slice(0, 1)
    first, last = int(hits[0]), int(hits[-1])
    return slice(first, last + 1) if last - first + 1 == len(hits) else hits


def log_softmax(logits):
    """log_softmax over the last dimension; on vocab-sharded DTensors spelt out in reductions that DTensor shards
    (loss_parallel's own log_softmax has a backward that is right only when nll_loss follows it)."""
    if not isinstance(logits, DTensor):
        return torch.log_softmax(logits, dim=-1)
    shifted = logits - logits.detach().amax(-1, keepdim=True)
    return shifted - shifted.exp().sum(-1, keepdim=True).log()
