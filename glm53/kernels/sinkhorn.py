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
    """Same iterations; backward recomputes the (tiny, [..., N, N]) iterates and runs the hand-derived reverse.

    For one normalisation y = x / (sum(x) + eps) along a dim, dx = (dy - sum(dy * y)) / (sum(x) + eps): four
    ops instead of autograd's division/broadcast/sum chain, which dominated mHC's backward (2 * iters divisions
    per site).
    """

    @staticmethod
    def forward(ctx, x, iters, eps):
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps = iters, eps
        return sinkhorn_reference(x, iters, eps)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dims = [-2] + [-1, -2] * (ctx.iters - 1)  # the normalisation order of sinkhorn_reference
        inputs, denominators = [], []
        y = x.float()
        for dim in dims:
            inputs.append(y)
            denominators.append(y.sum(dim=dim, keepdim=True) + ctx.eps)
            y = y / denominators[-1]
        g = grad.float()
        for dim, s, y_in in zip(reversed(dims), reversed(denominators), reversed(inputs)):
            y_out = y_in / s
            g = (g - (g * y_out).sum(dim=dim, keepdim=True)) / s
        return g.to(x.dtype), None, None


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fast-backward Sinkhorn (hand-written reverse, recomputed iterates); same signature and forward."""
    return _Sinkhorn.apply(x, iters, eps)


register("sinkhorn", "reference", sinkhorn_reference)
register("sinkhorn", "eager", sinkhorn)
