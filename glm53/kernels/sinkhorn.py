"""Sinkhorn-Knopp normalisation of mHC's comb matrix towards a doubly-stochastic matrix.

Legend: N streams, M tokens (the leading dims, flattened). x: [..., N, N] positive.
Following transformers' Glm5NextTextHyperConnection: first divide by column sums, then (iters - 1) rounds of
(rows, columns), each sum floored by `eps`. Computed in fp32.
sinkhorn_scaling and sinkhorn4_host / sinkhorn4_values run the same iterations on row and column scaling vectors
(the decode step's host arithmetic, generation/decode_host.py); they are not registered kernels.
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


def sinkhorn_scaling(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """sinkhorn_reference's iterations kept as row and column scalings of x: y_ij = r_i x_ij c_j, the matrix
    formed once at the end. Dividing y by its column sums plus eps is c_j <- c_j / (c_j (r^T x)_j + eps) (rows
    alike), so each step reads x and updates a length-N vector. The same iterates up to fp32 rounding (products
    regrouped). The tensor form of sinkhorn4_values (the decode step's host arithmetic)."""
    x = x.float()
    c = 1.0 / (x.sum(dim=-2) + eps)  # [..., N]: the first column normalisation (r = 1)
    r = torch.ones_like(c)
    for _ in range(iters - 1):
        r = r / (r * (x * c[..., None, :]).sum(dim=-1) + eps)
        c = c / (c * (x * r[..., :, None]).sum(dim=-2) + eps)
    return r[..., :, None] * x * c[..., None, :]


def sinkhorn4_host(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """sinkhorn_scaling for a few 4 x 4 matrices on the CPU, x [B, 4, 4] -> fp32, computed in Python floats.

    A decode step's comb matrix is 16 numbers: tensor ops on it cost their dispatch (~2 per normalisation, 39
    normalisations), while the unrolled scalar arithmetic of sinkhorn4_values costs a fraction of that. Python floats
    are fp64, so the result is the fp32 reference's up to fp32 rounding (as sinkhorn_scaling). Rows loop on the
    host: worth it for a batch of one or two (generation/decode_host.py)."""
    rows = [sinkhorn4_values(row, iters, eps) for row in x.float().reshape(-1, 16).tolist()]  # NOTE: syncs (host math)
    return torch.tensor(rows, dtype=torch.float32, device=x.device).view(x.shape)


def sinkhorn4_values(m: list[float], iters: int, eps: float) -> list[float]:
    """sinkhorn_scaling's iterations on one row-major 4 x 4 matrix m, unrolled (r_i, c_j: the scalings)."""
    a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = m
    c0, c1 = 1.0 / (a00 + a10 + a20 + a30 + eps), 1.0 / (a01 + a11 + a21 + a31 + eps)
    c2, c3 = 1.0 / (a02 + a12 + a22 + a32 + eps), 1.0 / (a03 + a13 + a23 + a33 + eps)
    r0 = r1 = r2 = r3 = 1.0
    for _ in range(iters - 1):
        r0 = r0 / (r0 * (a00 * c0 + a01 * c1 + a02 * c2 + a03 * c3) + eps)
        r1 = r1 / (r1 * (a10 * c0 + a11 * c1 + a12 * c2 + a13 * c3) + eps)
        r2 = r2 / (r2 * (a20 * c0 + a21 * c1 + a22 * c2 + a23 * c3) + eps)
        r3 = r3 / (r3 * (a30 * c0 + a31 * c1 + a32 * c2 + a33 * c3) + eps)
        c0 = c0 / (c0 * (a00 * r0 + a10 * r1 + a20 * r2 + a30 * r3) + eps)
        c1 = c1 / (c1 * (a01 * r0 + a11 * r1 + a21 * r2 + a31 * r3) + eps)
        c2 = c2 / (c2 * (a02 * r0 + a12 * r1 + a22 * r2 + a32 * r3) + eps)
        c3 = c3 / (c3 * (a03 * r0 + a13 * r1 + a23 * r2 + a33 * r3) + eps)
    r, c = (r0, r1, r2, r3), (c0, c1, c2, c3)
    return [r[i] * m[4 * i + j] * c[j] for i in range(4) for j in range(4)]


class _Sinkhorn(torch.autograd.Function):
    """Same iterations; backward runs the hand-derived reverse without autograd's per-op bookkeeping.

    For one normalisation y = x / s with s = sum(x) + eps along a dim, dx = (dy - sum(dy * y)) / s. Forward keeps
    only the output and the 2 * iters - 1 denominators (1/N of the iterates each); the reverse walks back from the
    output, rebuilding each step's input as y * s (exact up to one rounding per step).
    Both directions run on a [N, N, M] copy (M = all leading dims): a sum over either matrix dim is then N adds of
    contiguous length-M rows instead of a strided reduction over 4 numbers, and every step updates in place. The
    forward does the same arithmetic in the same order as sinkhorn_reference (bit-identical on CPU).
    """

    @staticmethod
    def forward(ctx, x, iters, eps):
        N = x.shape[-1]
        dims = [0] + [1, 0] * (iters - 1)  # sinkhorn_reference's order: columns (-2), then rows (-1), columns, ...
        y = x.float().reshape(-1, N, N).permute(1, 2, 0).clone(memory_format=torch.contiguous_format)  # [N, N, M], own
        denominators = []
        for dim in dims:
            denominators.append(y.sum(dim=dim, keepdim=True).add_(eps))
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
    return _Sinkhorn.apply(x, iters, eps)


register("sinkhorn", "reference", sinkhorn_reference)
register("sinkhorn", "fast", sinkhorn)
