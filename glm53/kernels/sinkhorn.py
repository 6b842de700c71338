"""Sinkhorn-Knopp normalisation of mHC's comb matrix towards a doubly-stochastic matrix.

Legend: N streams, M tokens (the leading dims, flattened). x: [..., N, N] positive.
Following transformers' Glm5NextTextHyperConnection: first divide by column sums, then (iters - 1) rounds of
(rows, columns), each sum floored by `eps`. Computed in fp32.
"""

from __future__ import annotations

import torch

from .dispatch import register
from .function import apply


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
    only the output and the 2 * iters - 1 denominators (1/N of the iterates each); the reverse walks back from the
    output, rebuilding each step's input as y * s (exact up to one rounding per step).
    Both directions run on a [N, N, M] copy (M = all leading dims): a sum over either matrix dim is then N adds of
    contiguous length-M rows instead of a strided reduction over 4 numbers, and every step updates in place.
    The forward's copy is the corner of an [N + 1, N + 1, M] buffer whose last row and column hold eps: a column sum
    over its N + 1 rows is sum + eps in one reduction (eps added last, as sinkhorn_reference adds it), so each of
    the 2 * iters - 1 steps is two ops (a sum and a division) where a separate `+ eps` made three. A decode step
    runs 16 of these per token on 4 x 4 matrices, where each op costs its dispatch and not its arithmetic. The same
    arithmetic as sinkhorn_reference up to the order of each sum's N + 1 terms (a rounding step per normalisation).
    """

    @staticmethod
    def forward(ctx, x, iters, eps):
        N = x.shape[-1]
        dims = [0] + [1, 0] * (iters - 1)  # sinkhorn_reference's order: columns (-2), then rows (-1), columns, ...
        flat = x.reshape(-1, N, N)
        padded = flat.new_full((N + 1, N + 1, flat.shape[0]), eps, dtype=torch.float32)
        y = padded[:N, :N]  # [N, N, M]
        y.copy_(flat.permute(1, 2, 0))
        summed = (padded[:, :N], padded[:N, :])  # dim 0: the columns with the eps row; dim 1: the rows with eps
        denominators = []
        for dim in dims:
            denominators.append(summed[dim].sum(dim=dim, keepdim=True))
            y.div_(denominators[-1])
        ctx.save_for_backward(y, *denominators)
        ctx.dims, ctx.in_dtype = dims, x.dtype
        # a contiguous copy in x's layout: a strided [M, N, N] view makes the callers' batched matmuls crawl
        return y.permute(2, 0, 1).reshape(x.shape).contiguous()

    @staticmethod
    def backward(ctx, grad):
        y, *denominators = ctx.saved_tensors
        N = grad.shape[-1]
        g = grad.float().reshape(-1, N, N).permute(1, 2, 0).clone(memory_format=torch.contiguous_format)  # [N, N, M]
        y = y.clone()
        for dim, s in zip(reversed(ctx.dims), reversed(denominators)):
            g.sub_((g * y).sum(dim=dim, keepdim=True)).div_(s)
            y.mul_(s)  # this step's input
        return g.permute(2, 0, 1).reshape(grad.shape).to(ctx.in_dtype).contiguous(), None, None


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fast-backward Sinkhorn (hand-written reverse, recomputed iterates); same signature and forward."""
    return apply(_Sinkhorn, x, iters, eps)


register("sinkhorn", "reference", sinkhorn_reference)
register("sinkhorn", "fast", sinkhorn)
