"""Sinkhorn-Knopp normalisation of mHC's comb matrix towards a doubly-stochastic matrix.

Legend: N streams. x: [..., N, N] positive. Following transformers' Glm5NextTextHyperConnection: first divide
by column sums, then (iters - 1) rounds of (rows, columns), each sum floored by `eps`. Computed in fp32.
"""

from __future__ import annotations

import torch

from .dispatch import register


def sinkhorn_reference(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    x = x.float()
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


class _Sinkhorn(torch.autograd.Function):
    """Same iterations; backward runs the hand-derived reverse without autograd's per-op bookkeeping.

    For one normalisation y = x / s with s = sum(x) + eps along a dim, dx = (dy - sum(dy * y)) / s. Forward keeps
    only the output and the 2 * iters - 1 denominators ([..., 1, N] or [..., N, 1]: 1/N of the iterates); the
    reverse walks back from the output, rebuilding each step's input as y * s (exact up to one rounding per step).
    """

    @staticmethod
    def forward(ctx, x, iters, eps):
        dims = [-2] + [-1, -2] * (iters - 1)  # the normalisation order of sinkhorn_reference
        y = x.float()
        denominators = []
        for dim in dims:
            denominators.append(y.sum(dim=dim, keepdim=True) + eps)
            y = y / denominators[-1]
        ctx.save_for_backward(y, *denominators)
        ctx.dims, ctx.in_dtype = dims, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        y, *denominators = ctx.saved_tensors
        g = grad.float()
        for dim, s in zip(reversed(ctx.dims), reversed(denominators)):
            g = (g - (g * y).sum(dim=dim, keepdim=True)) / s
            y = y * s  # this step's input
        return g.to(ctx.in_dtype), None, None


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fast-backward Sinkhorn (hand-written reverse, recomputed iterates); same signature and forward."""
    return _Sinkhorn.apply(x, iters, eps)


register("sinkhorn", "reference", sinkhorn_reference)
register("sinkhorn", "eager", sinkhorn)
