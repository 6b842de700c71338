"""The language-model head and cross-entropy in one op, without ever holding [M, vocab] fp32 logits.

Legend: M tokens (flattened B*T), D model width, vocab the vocabulary.
hidden: [M, D]; weight: [vocab, D] (lm_head); targets: [M] int (IGNORE_INDEX = -100 contributes nothing).
Returns the SUM over target tokens of -log softmax(hidden W^T)[target], in fp32 (callers divide by their own
token count, so the op composes with any normalisation).
The fast form walks the tokens in chunks whose fp32 logits fit LOGITS_BUDGET_BYTES: per chunk it computes the
logits in the input dtype, upcasts them to fp32 for the logsumexp, and keeps only the [M] fp32 log-normaliser;
backward recomputes each chunk's logits and forms softmax - onehot in place. Peak extra memory: one
[chunk, vocab] fp32 block (plus its input-dtype copy), whatever M is.
"""

from __future__ import annotations

import torch

from .dispatch import register

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


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        M = hidden.shape[0]
        lse = hidden.new_empty(M, dtype=_stat_dtype(hidden))
        total = hidden.new_zeros((), dtype=_stat_dtype(hidden))
        keep = targets != IGNORE_INDEX
        safe = targets.clamp_min(0).long()
        for start in range(0, M, chunk):
            end = min(start + chunk, M)
            logits = _chunk_logits(hidden[start:end], weight)
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[start:end, None]).squeeze(1)
            total += ((lse[start:end] - picked) * keep[start:end]).sum()
        ctx.save_for_backward(hidden, weight, safe, keep, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, safe, keep, lse = ctx.saved_tensors
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # accumulated in the weight's dtype (each chunk's GEMM sums in fp32 internally), like autograd's own grad
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            # d loss / d logits = (softmax - onehot(target)) * grad, zero on ignored rows
            d_logits = _chunk_logits(h, weight).sub_(lse[start:end, None]).exp_()
            d_logits[rows[: end - start], safe[start:end]] -= 1
            d_logits.mul_((grad * keep[start:end])[:, None])
            d_logits = d_logits.to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[start:end] = d_logits @ weight
            if d_weight is not None:
                d_weight.addmm_(d_logits.t(), h)
        return d_hidden, d_weight, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:  # fmt: skip
    """Chunked form (same result as the reference, same signature plus the chunk length in tokens)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy takes hidden [M, D] and targets [M], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")  # fmt: skip
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk or default_chunk(weight.shape[0]))


register("linear_cross_entropy", "reference", linear_cross_entropy_reference)
register("linear_cross_entropy", "fast", linear_cross_entropy)
