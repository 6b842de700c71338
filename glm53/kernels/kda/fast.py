"""The fast KDA chunk form (chunk.py registers it): the WY solve per chunk, the state recurrence over chunks and
the hand-written backward, all run over blocks of chunks (STATE_BUDGET) so that no tensor spans every chunk.

Legend: B batch, T time, H heads, K key width, V value width, C chunk length, T/C chunks (locals: N), n the chunks
of one block. Inputs and conventions as in chunk.py (q already scaled, fp32 or fp64).

Memory: a chunk's start state is [K, V], larger than the chunk's tokens ([C, K] with C < K), so per-chunk states
for the whole sequence would dominate. The forward keeps only the state at each block start (`boundaries`,
[B, H, blocks, K, V]); the backward walks the blocks last to first, recomputes one block's chunk
quantities and start states from its boundary state, and writes that block's gradients into the [B, T, H, *]
outputs, so its working set is one block plus the inputs and their gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...utils import ceil_div
from ..budgets import budget
from .decay import (
    BASE_BLOCK,
    _decay,
    _decayed_products,
    _rebase_is_safe,
    _rebased_adjoint,
    _rebased_factors,
    _rebased_products,
    _RebasedFactors,
)
from .varlen import DocMasks, doc_masks

# Chunk length of the fast form: intra-chunk work grows with C (products, the triangular solve), per-chunk state
# work with T/C; 32 balances the two on CPU (benchmarks/RESULTS.md).
FAST_CHUNK_SIZE = 32
# Block size, as the element count of one block's start states [B, H, n, K, V] (16 MiB in fp32): a block's other
# temporaries ([n, C, K + V] WY tensors, decay factors) are a small multiple of it, so this bounds the working set.
# Large enough that the batched per-block matmuls stay efficient (and few Python steps for narrow models); small
# enough that the working set stays in cache-friendly sizes (4 chunks per block at 64 heads of 128 x 128).
STATE_BUDGET = 1 << 22


def _chunk_size(T: int, device: torch.device | str = "cpu") -> int:
    longest = budget("kda_chunk", device, FAST_CHUNK_SIZE)  # kernels/budgets.py: 64 on CUDA
    return max(BASE_BLOCK, min(longest, 1 << max(T - 1, 0).bit_length()))


def _chunks_per_block(B: int, H: int, K: int, V: int, device: torch.device | str = "cpu") -> int:
    return max(1, budget("state", device, STATE_BUDGET) // (B * H * K * V))


def n_blocks(B: int, T: int, H: int, K: int, V: int, device: torch.device | str = "cpu") -> int:
    """Number of blocks of a [B, T, H] sequence (the boundary states the forward keeps) on `device`."""
    return ceil_div(ceil_div(T, _chunk_size(T, device)), _chunks_per_block(B, H, K, V, device))


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: one C-column triangular solve, reused by matmuls
    (cheaper than solving for the K + V right-hand sides directly, and the backward reuses it transposed)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def _to_chunks(C, *xs):
    """[B, t, H, *] -> [B, H, t/C, C, *] (zero-padded to whole chunks), contiguous."""
    N = ceil_div(xs[0].shape[1], C)
    pad = N * C - xs[0].shape[1]
    pad_to = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x  # noqa: E731
    return [pad_to(x).unflatten(1, (N, C)).permute(0, 3, 1, 2, 4).contiguous() for x in xs]


def _blocks(B: int, T: int, H: int, K: int, V: int, C: int, device: torch.device | str = "cpu"):
    """(first chunk, first token, end token) of every block of `_chunks_per_block` chunks."""
    step = _chunks_per_block(B, H, K, V, device) * C
    return [(t0 // C, t0, min(t0 + step, T)) for t0 in range(0, T, step)]


def _block_inputs(C, t0, t1, *xs):
    """Token range [t0, t1) of [B, T, H, *] tensors (beta [B, T, H] given a trailing 1) -> [B, H, n, C, *]."""
    return _to_chunks(C, *(x[:, t0:t1] if x.dim() == 4 else x[:, t0:t1, :, None] for x in xs))


def _block_masks(masks: DocMasks | None, n0: int, n: int) -> DocMasks | None:
    return None if masks is None else DocMasks(*(m[:, :, n0 : n0 + n] for m in masks))


def _write(out: torch.Tensor, n0: int, x: torch.Tensor) -> None:
    """Put a block's [B, H, n, C, *] values into `out` [B, T/C, C, H, *] (the [B, T, H, *] layout, padded)."""
    out[:, n0 : n0 + x.shape[2]].copy_(x.permute(0, 2, 3, 1, 4))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for equal leading dims (any last-two sizes), as one bmm (views with a row stride are fine)."""
    return torch.bmm(a.flatten(0, -3), b.flatten(0, -3)).view(*a.shape[:-1], b.shape[-1])


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """c + alpha * a @ b over equal leading dims, one fused baddbmm."""
    out = torch.baddbmm(c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=alpha)
    return out.view(c.shape)


class _WyChunks(NamedTuple):
    """The WY-form quantities of every chunk of a block ([B, H, n, ...]), shared by the forward and the backward.

    kEv = [k e^G | v] [C, K+V] and WU = L^-1 diag(beta) kEv = [W | Ub] side by side, so one matmul serves both
    right-hand sides (and, in backward, both of their gradients).
    """

    A: torch.Tensor  # [C, C] strictly lower k-k decayed products
    QK: torch.Tensor  # [C, C] lower q-k decayed products
    factors: _RebasedFactors | None  # None on the hierarchical path
    L_inv: torch.Tensor  # [C, C] (I + diag(beta) A)^-1
    E: torch.Tensor  # [C, K] e^G
    E_end: torch.Tensor  # [1, K] e^{G_C}
    D: torch.Tensor  # [C, K] e^{G_C - G}
    kEv: torch.Tensor  # [C, K+V]
    WU: torch.Tensor  # [C, K+V]
    Kd: torch.Tensor  # [C, K] k e^{G_C - G}


def _wy_chunks(q, k, v, beta, G, masks: DocMasks | None = None, rebase: bool = True) -> _WyChunks:
    """Chunked q, k [B, H, n, C, K], v [.., C, V], beta [.., C, 1], cumulative decay G [.., C, K]; `rebase`: the
    call's decision (`rebase_decision`) to use the rebased products (else the hierarchical ones).

    Per chunk (see kda_chunk_reference): W = L^-1 diag(beta) (K e^G), Ub = L^-1 diag(beta) V with
    L = I + diag(beta) A, all chunks at once; the states then follow `_scan`.
    """
    G_end = G[..., -1:, :]  # [B, H, n, 1, K]
    factors = _rebased_factors(k, q, G) if rebase else None
    if factors is not None:
        A, QK = _rebased_products(factors)  # [B, H, n, C, C] each
    else:
        both = _decayed_products(torch.stack([k, q]), k[None], G[None])
        A, QK = both[0].tril(-1), both[1]
    if masks is not None:  # packed documents: no product, start-state read or state write across a boundary
        A, QK = A * masks.same, QK * masks.same
    L_inv = _unit_lower_inverse(beta * A)  # L = I + diag(beta) A
    E, E_end, D = _decay(G), _decay(G_end), _decay(G_end - G)
    if masks is not None:
        E, E_end, D = E * masks.carry, E_end * masks.carry_end, D * masks.last
    kEv = torch.cat([k * E, v], dim=-1)  # [B, H, n, C, K+V]
    WU = _bmm(L_inv, kEv * beta)  # [W | Ub]
    return _WyChunks(A, QK, factors, L_inv, E, E_end, D, kEv, WU, k * D)


def _scan(ch: _WyChunks, S0: torch.Tensor):
    """The state recurrence over a block's chunks from S0 [B, H, K, V]:
        U_n = Ub_n - W_n S_n,   S_{n+1} = diag(e^{G_C}) S_n + Kd_n^T U_n
    -> (start states [B, H, n, K, V], U [B, H, n, C, V], the state after the block [B, H, K, V]).
    Two [C]-inner matmuls per chunk (C < K: cheaper than forming a [K, K] transition per chunk)."""
    B, H, n, C, K = ch.Kd.shape
    V = ch.WU.shape[-1] - K
    S = S0.reshape(B * H, K, V)
    WU, Kd, E_end = (x.flatten(0, 1) for x in (ch.WU, ch.Kd, ch.E_end))  # [B*H, n, *, *] views
    starts, Us = [], []
    for i in range(n):
        starts.append(S)
        U = torch.baddbmm(WU[:, i, :, K:], WU[:, i, :, :K], S, alpha=-1.0)  # [B*H, C, V]
        Us.append(U)
        S = torch.baddbmm(S * E_end[:, i].transpose(-1, -2), Kd[:, i].transpose(-1, -2), U)
    starts, U = torch.stack(starts, dim=1), torch.stack(Us, dim=1)
    return starts.view(B, H, n, K, V), U.view(B, H, n, C, V), S.view(B, H, K, V)


def rebase_decision(g: torch.Tensor, C: int, static: bool) -> bool:
    """Whether this call takes the rebased products: `static` (the gate's bound proves it, decay.rebase_is_static)
    or one reduction over every chunk of g [B, T, H, K] (one host read per call, not one per block)."""
    if static:
        return True
    return _rebase_is_safe(_to_chunks(C, g)[0].cumsum(dim=-2))


def kda_chunk_core(q, k, v, g, beta, S0, cu_seqlens=None, static_rebase: bool = False):
    """Scaled fp32/fp64 q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], S0 [B, H, K, V]
    -> (o [B, T, H, V], S_T [B, H, K, V], boundaries [B, H, blocks, K, V]: the state at each block start).

    Per block: the chunk quantities (`_wy_chunks`), the states (`_scan`), then O = (Q e^G) S_n + QK U at once.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = _chunk_size(T, q.device)
    N = ceil_div(T, C)
    masks = None if cu_seqlens is None else doc_masks(cu_seqlens, B, T, C, q.dtype)
    rebase = rebase_decision(g, C, static_rebase)
    o = q.new_empty(B, N, C, H, V)
    S, boundaries = S0, []
    for n0, t0, t1 in _blocks(B, T, H, K, V, C, q.device):
        # padding: k = beta = 0, g = 0 (no write, no decay)
        qc, kc, vc, gc, bc = _block_inputs(C, t0, t1, q, k, v, g, beta)  # [B, H, n, C, *]
        ch = _wy_chunks(qc, kc, vc, bc, gc.cumsum(dim=-2), _block_masks(masks, n0, qc.shape[2]), rebase)
        boundaries.append(S)
        starts, U, S = _scan(ch, S)
        _write(o, n0, _baddbmm(_bmm(ch.QK, U), qc * ch.E, starts))
    return o.flatten(1, 2)[:, :T], S, torch.stack(boundaries, dim=2)


class _BlockGrads(NamedTuple):
    """Gradients of one block, [B, H, n, C, *]."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor


def _walk_back(ch: _WyChunks, starts, U, dU, dS_o, dS):
    """The state recurrence of `_scan` differentiated, last chunk first. dU [B, H, n, C, V] and dS_o [.., K, V] are
    the output's direct gradients of U_n and S_n, dS [B, H, K, V] the gradient of the state after the block ->
    (dU_total [B, H, n, C, V], dKd [.., C, K], d e^{G_C} [.., 1, K], dS at the block start [B, H, K, V]):
        dU_n += Kd_n dS_{n+1};  dKd_n = U_n dS_{n+1}^T;  d e^{G_C} = diag(dS_{n+1} S_n^T);
        dS_n = dS_o,n + diag(e^{G_C}) dS_{n+1} - W_n^T dU_n."""
    B, H, n, C, K = ch.Kd.shape
    V = U.shape[-1]
    WU, Kd, E_end, S, U, dU, dS_o = (x.flatten(0, 1) for x in (ch.WU, ch.Kd, ch.E_end, starts, U, dU, dS_o))
    dS = dS.reshape(B * H, K, V)
    dUs, dKds, dEs = [], [], []
    for i in range(n - 1, -1, -1):
        dU_i = torch.baddbmm(dU[:, i], Kd[:, i], dS)
        dKds.append(torch.bmm(U[:, i], dS.transpose(-1, -2)))
        dEs.append((dS * S[:, i]).sum(-1))
        dS = torch.baddbmm(
            torch.addcmul(dS_o[:, i], dS, E_end[:, i].transpose(-1, -2)),
            WU[:, i, :, :K].transpose(-1, -2),
            dU_i,
            alpha=-1.0,
        )
        dUs.append(dU_i)
    stacked = lambda xs, *shape: torch.stack(xs[::-1], dim=1).view(B, H, n, *shape)  # noqa: E731
    return stacked(dUs, C, V), stacked(dKds, C, K), stacked(dEs, 1, K), dS.view(B, H, K, V)


def _block_backward(q, k, beta, do, ch: _WyChunks, starts, U, dS, masks) -> tuple[_BlockGrads, torch.Tensor]:
    """One block's gradients (rebased path) given dS, the gradient of the state after it -> (grads, dS at its start).

    o = qE S_n + QK U, U = Ub - W S_n; the WY solve: dR = L^-T d[W | Ub], dL = -dR [W | Ub]^T; then the decay
    factors, the decayed products (`_rebased_adjoint`) and the cumulative sum G = cumsum(g)."""
    K = k.shape[-1]
    qE = q * ch.E
    dQK = _bmm(do, U.transpose(-1, -2)).tril()
    if masks is not None:  # the products between documents are constants (zero): no gradient reaches them
        dQK = dQK * masks.same
    dqE = _bmm(do, starts.transpose(-1, -2))
    dU, dKd, dE_end, dS = _walk_back(
        ch, starts, U, _bmm(ch.QK.transpose(-1, -2), do), _bmm(qE.transpose(-1, -2), do), dS
    )
    dWU = torch.cat([-_bmm(dU, starts.transpose(-1, -2)), dU], dim=-1)  # [dW | dUb]
    dR = _bmm(ch.L_inv.transpose(-1, -2), dWU)  # [B, H, n, C, K+V]
    dL = -_bmm(dR, ch.WU.transpose(-1, -2)).tril(-1)
    if masks is not None:
        dL = dL * masks.same
    dbeta = (dL * ch.A).sum(-1, keepdim=True) + (dR * ch.kEv).sum(-1, keepdim=True)
    dkEv = dR * beta
    dk_w, dv = dkEv[..., :K] * ch.E, dkEv[..., K:]  # kEv = [k E | v]
    KdKd = dKd * ch.Kd
    dG = dk_w * k - KdKd
    dG_end = KdKd.sum(dim=-2, keepdim=True) + dE_end * ch.E_end
    dq = dqE * ch.E
    dG = dG + dqE * qE
    dX_rows, dk_cols, dG_products = _rebased_adjoint(beta * dL, dQK, ch.factors, k, q)
    s = dX_rows.shape[-2]
    dk = dk_w + dKd * ch.D + dk_cols
    dk.unflatten(-2, (-1, s)).add_(dX_rows[..., 0, :, :])
    dq.unflatten(-2, (-1, s)).add_(dX_rows[..., 1, :, :])
    dG = dG + dG_products
    dG[..., -1:, :] += dG_end
    dg = dG.flip(-2).cumsum(dim=-2).flip(-2)  # G = cumsum(g)
    return _BlockGrads(dq, dk, dv, dg, dbeta), dS


def kda_chunk_backward(q, k, v, g, beta, do, dS, boundaries, cu_seqlens=None, static_rebase: bool = False):
    """Hand-derived backward of `kda_chunk_core` on the rebased path (`_rebase_is_safe`); q already scaled.

    Blocks last to first: recompute the block's chunk quantities (`_wy_chunks`) and states (`_scan`, from its
    boundary state), then `_block_backward`. Returns dq (w.r.t. the scaled q), dk, dv, dg, dbeta [B, T, H], dS0,
    or None when the decays are too steep for the rebased factors (the caller then differentiates by recompute).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = _chunk_size(T, q.device)
    N = ceil_div(T, C)
    blocks = _blocks(B, T, H, K, V, C, q.device)
    if not rebase_decision(g, C, static_rebase):
        return None
    masks = None if cu_seqlens is None else doc_masks(cu_seqlens, B, T, C, q.dtype)
    outs = _BlockGrads(*(q.new_empty(B, N, C, H, width) for width in (K, K, V, K, 1)))
    dS = dS.to(q.dtype)
    for b in range(len(blocks) - 1, -1, -1):
        n0, t0, t1 = blocks[b]
        qc, kc, vc, gc, bc, doc = _block_inputs(C, t0, t1, q, k, v, g, beta, do)
        block_masks = _block_masks(masks, n0, qc.shape[2])
        ch = _wy_chunks(qc, kc, vc, bc, gc.cumsum(dim=-2), block_masks)
        starts, U, _ = _scan(ch, boundaries[:, :, b])
        grads, dS = _block_backward(qc, kc, bc, doc, ch, starts, U, dS, block_masks)
        for out, x in zip(outs, grads):
            _write(out, n0, x)
    dq, dk, dv, dg, dbeta = (x.flatten(1, 2)[:, :T] for x in outs)
    return dq, dk, dv, dg, dbeta[..., 0], dS
