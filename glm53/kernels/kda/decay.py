"""Intra-chunk decayed products of the fast KDA chunk form (chunk.py), and their adjoint.

Legend: ... leading dims (B, H, T/C chunks), C chunk length, K key width, s rows per block (local).
For a, b [..., C, K] and the cumulative log-decay G [..., C, K] (from the chunk start, non-increasing):
    M[t, j] = sum_c a_tc b_jc exp(G_tc - G_jc)  for j <= t (0 above),
formed without any [C, C, K] tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The intra-chunk products M[t, j] = sum_c a_tc b_jc exp(G_tc - G_jc) (j <= t) are formed without any [C, C, K]
# tensor by factorising the decay through a reference point r:  exp(G_t - G_j) = exp(G_t - G_r) * exp(G_r - G_j).
#
# Sub-chunk rebasing (used when it is provably safe): r = the first token of each SUB_CHUNK-token row block.
# Row factors exp(G_t - G_r) are <= 1; column factors exp(G_r - G_j) are <= 1 for earlier blocks and at most
# exp(span) inside the row's own block, where span = G_r - G_last of that block (15 steps). The kernel checks
# span <= REBASE_MAX_EXP = 80 < log(fp32 max) = 88.7 (one reduction per call), which the -5 lower-bounded gate
# always satisfies (15 * 5 = 75). Every product row * column is exp(G_t - G_j) * a * b with |.| <= 1 (unit-norm
# q, k), so the matmul sums cannot overflow either, and no row factor falls below exp(-80) (fp32 normal range
# reaches exp(-87)). Columns above the diagonal block are masked; their exponent is clamped to
# REBASE_MAX_EXP so they stay finite before the mask. When the check fails (softplus gate with large rates) the
# hierarchical form below is used instead.
#
# Hierarchical boundary factorisation (any gate, e.g. the unbounded softplus one): diagonal blocks of BASE_BLOCK
# tokens use the explicit pairwise form (masked to j <= t before the exp); a block of 2s tokens is its two
# diagonal halves plus the off-diagonal s x s block factorised at r = last token of the first half, where BOTH
# exponents are <= 0 (g <= 0 and j <= r < t). Every factor lies in [0, 1], so nothing can overflow for any g; a
# factor that underflows to 0 bounds a true product below fp32's smallest normal, so the error is absolute and
# negligible. The inter-chunk terms use exp(G_t), exp(G_C - G_j) and exp(G_C): exponents <= 0 as well.
SUB_CHUNK = 16  # rebasing block: 15 steps of the -5 gate span at most 75 <= REBASE_MAX_EXP
REBASE_MAX_EXP = 80.0  # largest exponent the rebased path may evaluate (fp32 overflows above ~88.7)
# Every decay exponent (always <= 0 here) is floored at -EXP_FLOOR before exp(): exp(-80) = 1.8e-35 is still a
# normal fp32 number, while exp(-100) would be a denormal, which x86 CPUs process far more slowly (the matmuls
# below would crawl). The change to any product is below 1.8e-35 absolute (the other factor is <= 1).
EXP_FLOOR = 80.0
BASE_BLOCK = 8  # diagonal blocks of the hierarchical form use the explicit pairwise decay


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for decay exponents, floored at exp(-EXP_FLOOR) (no denormals; see EXP_FLOOR)."""
    return x.clamp(min=-EXP_FLOOR).exp()


def _pairwise_base(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, s: int) -> torch.Tensor:
    """[..., C, K] -> [..., C/s, s, s] blocks M[t, j] = sum_c a_tc b_jc exp(G_tc - G_jc), j <= t (0 above)."""
    a, b, G = (x.unflatten(-2, (-1, s)) for x in (a, b, G))  # [..., C/s, s, K]
    causal = torch.ones(s, s, dtype=torch.bool, device=G.device).tril()
    diff = (
        (G[..., :, None, :] - G[..., None, :, :]).clamp(min=-EXP_FLOOR).masked_fill(~causal[:, :, None], float("-inf"))
    )
    return torch.einsum("...tc,...jc,...tjc->...tj", a, b, diff.exp())


def _decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """[..., C, K] x [..., C, K] -> [..., C, C] lower-triangular M[t, j] = sum_c a_tc b_jc exp(G_tc - G_jc)."""
    C = G.shape[-2]
    s = min(BASE_BLOCK, C)
    M = _pairwise_base(a, b, G, s)  # [..., C/s, s, s] diagonal blocks
    while s < C:
        halves = lambda x: x.unflatten(-2, (-1, 2, s))  # noqa: E731  [..., C/2s, 2, s, K]
        a2, b2, G2 = halves(a), halves(b), halves(G)
        ref = G2[..., 0, s - 1 : s, :]  # [..., C/2s, 1, K] the boundary token
        rows = a2[..., 1, :, :] * _decay(G2[..., 1, :, :] - ref)
        cols = b2[..., 0, :, :] * _decay(ref - G2[..., 0, :, :])
        off = rows @ cols.transpose(-1, -2)  # [..., C/2s, s, s]
        diag = M.unflatten(-3, (-1, 2))  # [..., C/2s, 2, s, s]
        top = torch.cat([diag[..., 0, :, :], torch.zeros_like(off)], dim=-1)
        bottom = torch.cat([off, diag[..., 1, :, :]], dim=-1)
        M = torch.cat([top, bottom], dim=-2)  # [..., C/2s, 2s, 2s]
        s *= 2
    return M.squeeze(-3)


class _RebasedFactors(NamedTuple):
    """Factors of the rebased intra-chunk products, computed once per chunked call and shared by the products and
    their adjoint. With s = SUB_CHUNK rows per block and r the block's first token (see the comment above):
    rows [..., C/s, 2, s, K]: k_t e^{G_t - G_r} then q_t e^{G_t - G_r}, stacked per row block (one matmul for both);
    cols [..., C/s, C, K]: k_j e^{G_r - G_j} for every column j and row block;
    row_decay [..., C/s, s, K] and col_decay [..., C/s, C, K]: the exponential factors alone."""

    rows: torch.Tensor
    cols: torch.Tensor
    row_decay: torch.Tensor
    col_decay: torch.Tensor


def _rebased_factors(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor) -> _RebasedFactors:
    """k, q, G [..., C, K] -> the factors of A = k k^T * decay and QK = q k^T * decay; only when `_rebase_is_safe(G)`.

    The row operands are multiplied straight into their stacked layout (`out=` a permuted view): no stacked copy
    of k and q, and no concatenation afterwards.
    """
    C, K = G.shape[-2:]
    s = min(SUB_CHUNK, C)
    G_blocks = G.unflatten(-2, (-1, s))  # [..., C/s, s, K]
    ref = G_blocks[..., :1, :]  # [..., C/s, 1, K] first token of each row block
    row_decay = _decay(G_blocks - ref)
    col_decay = (ref - G[..., None, :, :]).clamp(-EXP_FLOOR, REBASE_MAX_EXP).exp()  # [..., C/s, C, K]
    k_rows, q_rows = k.unflatten(-2, (-1, s)), q.unflatten(-2, (-1, s))
    # Under autograd (the steep-decay fallback recomputes the forward, whose safe blocks still come here) out= is
    # not differentiable: stack instead.
    if any(x.requires_grad for x in (k, q, G)):
        rows = torch.stack([k_rows * row_decay, q_rows * row_decay], dim=-3)
    else:
        rows = G.new_empty(*G_blocks.shape[:-2], 2, s, K)
        torch.mul(k_rows, row_decay, out=rows[..., 0, :, :])
        torch.mul(q_rows, row_decay, out=rows[..., 1, :, :])
    return _RebasedFactors(rows, k[..., None, :, :] * col_decay, row_decay, col_decay)


def _causal_keep(C: int, s: int, device: torch.device) -> torch.Tensor:
    """[2, C/s, s, C] bool: strictly lower (j < t) for the k rows, lower with the diagonal (j <= t) for the q rows."""
    t = torch.arange(C, device=device)
    keep = torch.stack([t[:, None] > t[None, :], t[:, None] >= t[None, :]])  # [2, C, C]
    return keep.view(2, C // s, s, C)


def _rebased_products(f: _RebasedFactors) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (A [..., C, C] strictly lower, QK [..., C, C] lower with the diagonal), the same sums as
    `_decayed_products` of (k, k) and (q, k). One batched matmul for both; the mask is applied while the blocks
    are written back to [C, C] order (no separate split/stack copies)."""
    *lead, nb, R, s, K = f.rows.shape
    C = f.cols.shape[-2]
    M = (f.rows.flatten(-3, -2) @ f.cols.transpose(-1, -2)).view(*lead, nb, R, s, C)
    keep = _causal_keep(C, s, M.device).view(R, *([1] * len(lead)), nb, s, C)
    if M.requires_grad:  # under autograd (the steep-decay fallback's recompute): out= has no autograd
        out = torch.where(keep, M.movedim(-3, 0), M.new_zeros(()))
    else:
        out = M.new_empty(R, *lead, nb, s, C)
        torch.where(keep, M.movedim(-3, 0), M.new_zeros(()), out=out)  # above the diagonal: finite (clamped)
    return out[0].view(*lead, C, C), out[1].view(*lead, C, C)


def rebase_is_static(gate_floor: float | None) -> bool:
    """True when a gate bounded below by `gate_floor` (g >= gate_floor, the bounded gate's lower_bound) makes every
    row block's span at most (SUB_CHUNK - 1) * |gate_floor| <= REBASE_MAX_EXP: the rebased path is then safe
    without reading the data (no host sync). The released -5 gate: 15 * 5 = 75 <= 80."""
    return gate_floor is not None and (SUB_CHUNK - 1) * max(-gate_floor, 0.0) <= REBASE_MAX_EXP


def _rebase_is_safe(G: torch.Tensor) -> bool:
    """True when every row block's own decay span is <= REBASE_MAX_EXP (always so for the -5 bounded gate).
    One reduction and one host read: the kernels call it once per call over every chunk, never per block."""
    C = G.shape[-2]
    s = min(SUB_CHUNK, C)
    blocks = G.unflatten(-2, (-1, s))
    span = blocks[..., 0, :] - blocks[..., -1, :]  # >= 0
    return bool(span.max() <= REBASE_MAX_EXP)  # NOTE: syncs (free on CPU)


def _rebased_adjoint(dA: torch.Tensor, dQK: torch.Tensor, f: _RebasedFactors, k: torch.Tensor, q: torch.Tensor):
    """Gradients of the rebased products (`_rebased_products`) given dA, dQK [..., C, C] (already masked).

    With dP_r the gradient of the r-th product (rows_r = k, q), X_rt = sum_j dP_r[t, j] k_j e^{G_t - G_j} and
    Y_j = sum_{r, t} dP_r[t, j] rows_rt e^{G_t - G_j}:  d rows_r = X_r, dk (as the column operand) = Y and
    dG = k X_k + q X_q - k Y. Same rebased factors as the forward (the masked entries are exact zeros in dP, so the
    clamped column factors above the diagonal block never contribute). Returns (X [..., C/s, 2, s, K] in the
    stacked row-block layout, Y [..., C, K], dG [..., C, K]).
    """
    *lead, nb, R, s, K = f.rows.shape
    C = f.cols.shape[-2]
    dP = dA.new_empty(*lead, nb, R, s, C)  # the two gradients in the stacked row-block layout of f.rows
    dP[..., 0, :, :] = dA.view(*lead, nb, s, C)
    dP[..., 1, :, :] = dQK.view(*lead, nb, s, C)
    dP = dP.flatten(-3, -2)  # [..., C/s, 2s, C]
    X = (dP @ f.cols).view(*lead, nb, R, s, K).mul_(f.row_decay[..., None, :, :])
    Y = ((dP.transpose(-1, -2) @ f.rows.flatten(-3, -2)) * f.col_decay).sum(dim=-3)  # [..., C, K]
    blocked = lambda x: x.unflatten(-2, (-1, s))  # noqa: E731  [..., C, K] -> [..., C/s, s, K]
    dG = blocked(k) * X[..., 0, :, :]
    dG.addcmul_(blocked(q), X[..., 1, :, :])
    dG = dG.view(*lead, C, K).sub_(k * Y)
    return X, Y, dG
