"""The language-model head and cross-entropy in one op, without ever holding [M, vocab] fp32 logits.

Legend: M tokens (flattened B*T), D model width, vocab the vocabulary.
hidden: [M, D]; weight: [vocab, D] (lm_head); targets: [M] int (IGNORE_INDEX = -100 contributes nothing).
Returns the SUM over target tokens of -log softmax(hidden W^T)[target], in fp32 (callers divide by their own
token count, so the op composes with any normalisation).
The fast form walks the tokens in chunks whose fp32 logits fit LOGITS_BUDGET_BYTES: per chunk it computes the
logits in the input dtype, upcasts them to fp32 for the logsumexp, and keeps only the [M] fp32 log-normaliser;
backward recomputes each chunk's logits and forms softmax - onehot in place. Peak extra memory: one
[chunk, vocab] fp32 block (plus its input-dtype copy), whatever M is.
`chunk_statistics` and `chunk_gradients` take a weight holding any contiguous block of the vocabulary, so the
vocab-parallel loss (glm53/parallel/vocab_loss.py) runs the same chunks on one rank's rows and only combines the
per-token statistics across ranks.
"""

from __future__ import annotations

import torch

from .dispatch import register
from .function import apply

IGNORE_INDEX = -100
LOGITS_BUDGET_BYTES = 128 * 2**20  # one fp32 logits block: ~216 tokens at the released vocabulary (154,880)


def default_chunk(vocab: int) -> int:
    return max(1, LOGITS_BUDGET_BYTES // (4 * vocab))


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain form: full fp32 logits, then cross-entropy summed over target tokens."""
    logits = (hidden @ weight.t()).to(_stat_dtype(hidden))
    return torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=IGNORE_INDEX, reduction="sum")


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32  # fp64 stays fp64 (ground-truth tests)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # [chunk, vocab]: the GEMM in the input dtype, softmax statistics in fp32
    return (hidden @ weight.t()).to(_stat_dtype(hidden))


def chunk_statistics(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, first: int | torch.Tensor = 0
) -> tuple[torch.Tensor, ...]:
    """Softmax statistics over `weight`'s rows, which hold vocabulary ids first .. first + rows - 1 (all of them on
    one process; one rank's shard under a vocab-parallel head), chunk by chunk over the tokens.

    -> lse [M] (log-sum-exp over these rows), picked [M] (the target's logit, 0 where the target is ignored or not
    in these rows), safe [M] (the target's row, 0 where not in these rows), hit [M] bool (target in these rows).
    """
    if chunk < 1:  # a step below 1 would skip every block and leave the statistics uninitialised
        raise ValueError(f"linear_cross_entropy: chunk must be a positive number of tokens, got {chunk}")
    M, rows = hidden.shape[0], weight.shape[0]
    local = targets.long() - first
    hit = (local >= 0) & (local < rows)  # IGNORE_INDEX is negative: never a hit
    safe = torch.where(hit, local, 0)
    lse = hidden.new_empty(M, dtype=_stat_dtype(hidden))
    picked = hidden.new_empty(M, dtype=_stat_dtype(hidden))
    for start in range(0, M, chunk):
        end = min(start + chunk, M)
        logits = _chunk_logits(hidden[start:end], weight)
        lse[start:end] = torch.logsumexp(logits, dim=-1)
        picked[start:end] = logits.gather(1, safe[start:end, None]).squeeze(1)
    return lse, picked * hit, safe, hit


def chunk_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    safe: torch.Tensor,
    hit: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of sum_i scale_i * (lse_i - logit_i[target_i]) through `weight`'s rows, recomputing each chunk's
    logits: d logits = (softmax - onehot(target where `hit`)) * scale, with `lse` [M] the log-normaliser over the
    WHOLE vocabulary. -> (d hidden [M, D] from these rows alone, d weight [rows, D]) or None where not needed."""
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    # accumulated in the weight's dtype (each chunk's GEMM sums in fp32 internally), like autograd's own grad
    d_weight = torch.zeros_like(weight) if need_weight else None
    rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        h = hidden[start:end]
        d_logits = _chunk_logits(h, weight).sub_(lse[start:end, None]).exp_()
        d_logits[rows[: end - start], safe[start:end]] -= hit[start:end].to(d_logits.dtype)
        d_logits.mul_(scale[start:end, None])
        d_logits = d_logits.to(hidden.dtype)
        if d_hidden is not None:
            d_hidden[start:end] = d_logits @ weight
        if d_weight is not None:
            d_weight.addmm_(d_logits.t(), h)
    return d_hidden, d_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        lse, picked, safe, hit = chunk_statistics(hidden, weight, targets, chunk)
        total = ((lse - picked) * hit).sum()  # on one process every kept target is a hit
        ctx.save_for_backward(hidden, weight, safe, hit, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, safe, hit, lse = ctx.saved_tensors
        d_hidden, d_weight = chunk_gradients(
            hidden, weight, safe, hit, lse, grad * hit, ctx.chunk, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return d_hidden, d_weight, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Chunked form (same result as the reference, same signature plus the chunk length in tokens)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy takes hidden [M, D] and targets [M], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    return apply(_LinearCrossEntropy, hidden, weight, targets, chunk or default_chunk(weight.shape[0]))


register("linear_cross_entropy", "reference", linear_cross_entropy_reference)
register("linear_cross_entropy", "fast", linear_cross_entropy)
