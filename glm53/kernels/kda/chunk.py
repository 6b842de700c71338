"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel forget gate.

Legend: B batch, T time, H heads, K key width, V value width, C chunk length, T/C chunks (rounded up; the
functions' locals call the chunk count N), n the length of one chunk in the chunked reference.

Conventions (shared by every implementation in this file, same signature):
- q, k: [B, T, H, K], already L2-normalised by the caller; `scale` multiplies q (default K^-0.5).
- v: [B, T, H, V].
- g: [B, T, H, K] log-space decay (g <= 0): the state is multiplied by exp(g_t) before step t writes.
- beta: [B, T, H] write strength in (0, 1).
- initial_state / final state: [B, H, K, V], fp32 (fp64 for fp64 inputs).
Per step:  S_t = diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = S_t^T (scale q_t).
All arithmetic is fp32, or fp64 when q is fp64 (so the references can serve as ground truth); o is returned in
q's dtype and the state in the compute dtype.
Packed documents (`cu_seqlens` over the flattened B * T tokens, kernels/varlen.py): the state restarts from zero
at every document start, as if each document ran alone (kda/varlen.py: the references loop over the documents,
the fast form masks each chunk's cross-document terms, row by row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...utils import ceil_div
from ..dispatch import register
from ..opaque import autograd_inside_op
from ..varlen import check_cu_seqlens
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
from .varlen import DocMasks, doc_masks, no_states, per_document

DEFAULT_CHUNK_SIZE = 64


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (ground truth for gradient checks), fp32 for everything else."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, initial_state):
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if initial_state is None:
        state = q.new_zeros(B, H, K, V)
    else:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(B, H, K, V)}")
        state = initial_state.to(dtype)
    return q * scale, k, v, g, beta, state


def kda_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule one token at a time: the definition every other form is tested against."""
    if cu_seqlens is not None:
        return per_document(kda_recurrent_reference, (q, k, v, g, beta), scale, initial_state, output_final_state,
                            cu_seqlens)  # fmt: skip
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]  # [B, H, K, V]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), (S if output_final_state else None)


def kda_chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked (WY / UT-transform) form, written for clarity: one chunk at a time.

    Inside a chunk with cumulative decay G_t = sum_{s<=t} g_s (from the chunk start) and start state S0, the
    writes U = [u_1 .. u_C] solve the unit lower-triangular system
        (I + diag(beta) A) U = diag(beta) (V - (K * exp(G)) S0),   A_tj = sum_c k_t,c k_j,c exp(G_t,c - G_j,c), j < t,
    and then  O = (Q * exp(G)) S0 + (M * QK_decay) U  with the causal mask M (diagonal included), and
    S_C = diag(exp(G_C)) S0 + sum_j (k_j * exp(G_C - G_j)) u_j^T.
    The pairwise decay exp(G_t - G_j), t >= j, is always <= 1, so nothing can overflow; the price is the
    [C, C, K] tensor per chunk, which the fast kernel avoids.
    """
    if cu_seqlens is not None:
        run = lambda *xs, scale: kda_chunk_reference(*xs, scale=scale, chunk_size=chunk_size)  # noqa: E731
        return per_document(run, (q, k, v, g, beta), scale, initial_state, output_final_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    B, T, H, K = k.shape
    C = chunk_size
    outputs = []
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    for start in range(0, T, C):
        end = min(start + C, T)
        n = end - start
        qc, kc, vc, bc = (x[:, start:end].transpose(1, 2) for x in (q, k, v, beta))  # [B, H, n, *]
        G = g[:, start:end].transpose(1, 2).cumsum(dim=2)  # [B, H, n, K]
        mask = causal[:n, :n]
        # decay[t, j, c] = exp(G_t,c - G_j,c) for j <= t, 0 above the diagonal
        diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~mask[:, :, None], float("-inf"))
        decay = diff.exp()  # [B, H, n, n, K]
        kk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", kc, kc, decay).tril(-1)  # strictly lower
        system = torch.eye(n, dtype=q.dtype, device=q.device) + bc[..., None] * kk
        rhs = bc[..., None] * (vc - (kc * G.exp()) @ S)
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, n, V]
        qk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", qc, kc, decay)
        outputs.append(((qc * G.exp()) @ S + qk @ U).transpose(1, 2))
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        S = S * G_end.transpose(-1, -2).exp() + (kc * (G_end - G).exp()).transpose(-1, -2) @ U
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------- fast form
# The intra-chunk decayed products (sub-chunk rebasing, the hierarchical factorisation, why neither can overflow)
# live in decay.py; this part is the WY solve, the state recurrence over chunks and the hand-written backward.
# Chunk length of the fast form: intra-chunk work grows with C (products, the triangular solve), per-chunk state
# work with T/C; 32 balances the two on CPU (benchmarks/RESULTS.md).
FAST_CHUNK_SIZE = 32
RECURRENT_MAX_T = 1  # single-token steps (decode) use the recurrent form directly


def _chunk_size(T: int) -> int:
    return max(BASE_BLOCK, min(FAST_CHUNK_SIZE, 1 << max(T - 1, 0).bit_length()))


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: one C-column triangular solve, reused by matmuls
    (cheaper than solving for the K + V right-hand sides directly, and the backward reuses it transposed)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def _scan_states(transition: torch.Tensor, inject: torch.Tensor, S0: torch.Tensor):
    """S_{n+1} = transition_n S_n + inject_n over chunks: [B, H, T/C, K, K], [B, H, T/C, K, V], S0 [B, H, K, V] ->
    (chunk start states [B, H, T/C, K, V], final state [B, H, K, V]). The chunk axis is sliced in place
    (batch-strided matmuls), so no permuted copy of the per-chunk tensors is made."""
    B, H, N, K, V = inject.shape
    S = S0.reshape(B * H, K, V)
    states = []
    for transition_n, inject_n in zip(transition.flatten(0, 1).unbind(1), inject.flatten(0, 1).unbind(1)):
        states.append(S)
        S = torch.baddbmm(inject_n, transition_n, S)
    return torch.stack(states, dim=1).view(B, H, N, K, V), S.view(B, H, K, V)


def _to_chunks(T, C, *xs):
    """[B, T, H, *] -> [B, H, T/C, C, *] (zero-padded to (T/C) * C tokens), contiguous."""
    N = ceil_div(T, C)
    pad = N * C - T
    pad_to = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x  # noqa: E731
    return [pad_to(x).unflatten(1, (N, C)).permute(0, 3, 1, 2, 4).contiguous() for x in xs]


def _from_chunks(T, *xs):
    """[B, H, T/C, C, *] -> [B, T, H, *] (padding dropped)."""
    return [x.permute(0, 2, 3, 1, 4).flatten(1, 2)[:, :T] for x in xs]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for equal leading dims (any last-two sizes), as one bmm (views with a row stride are fine)."""
    return torch.bmm(a.flatten(0, -3), b.flatten(0, -3)).view(*a.shape[:-1], b.shape[-1])


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """c + alpha * a @ b over equal leading dims, one fused baddbmm."""
    out = torch.baddbmm(c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=alpha)
    return out.view(c.shape)


class _WyChunks(NamedTuple):
    """The WY-form quantities of every chunk ([B, H, T/C, ...]), shared by the forward and the hand-written backward.

    kEv = [k e^G | v] [C, K+V] and WU = L^-1 diag(beta) kEv = [W | Ub] side by side, so one matmul serves both
    right-hand sides (and, in backward, both of their gradients); TI = Kd^T WU = [Kd^T W | inject] likewise.
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
    transition: torch.Tensor  # [K, K] diag(e^{G_C}) - Kd^T W
    starts: torch.Tensor  # [K, V] state at each chunk start
    S: torch.Tensor  # [B, H, K, V] final state


def _wy_chunks(q, k, v, beta, G, S0, masks: DocMasks | None = None) -> _WyChunks:
    """Chunked q, k [B, H, T/C, C, K], v [.., C, V], beta [.., C, 1], cumulative decay G [.., C, K], S0 [B, H, K, V].

    Per chunk (see kda_chunk_reference): W = L^-1 diag(beta) (K e^G), Ub = L^-1 diag(beta) V with
    L = I + diag(beta) A, all chunks at once; then the states follow the linear recurrence
    S_{n+1} = (diag(e^{G_C}) - Kd^T W) S_n + Kd^T Ub   (Kd = K e^{G_C - G}), one batched matmul per chunk.
    """
    K = k.shape[-1]
    G_end = G[..., -1:, :]  # [B, H, T/C, 1, K]
    factors = _rebased_factors(k, q, G) if _rebase_is_safe(G) else None
    if factors is not None:
        A, QK = _rebased_products(factors)  # [B, H, T/C, C, C] each
    else:
        both = _decayed_products(torch.stack([k, q]), k[None], G[None])
        A, QK = both[0].tril(-1), both[1]
    if masks is not None:  # packed documents: no product, start-state read or state write across a boundary
        A, QK = A * masks.same, QK * masks.same
    L_inv = _unit_lower_inverse(beta * A)  # L = I + diag(beta) A
    E, E_end, D = _decay(G), _decay(G_end), _decay(G_end - G)
    if masks is not None:
        E, E_end, D = E * masks.carry, E_end * masks.carry_end, D * masks.last
    kEv = torch.cat([k * E, v], dim=-1)  # [B, H, T/C, C, K+V]
    WU = _bmm(L_inv, kEv * beta)  # [W | Ub]
    Kd = k * D
    TI = _bmm(Kd.transpose(-1, -2), WU)  # [B, H, T/C, K, K+V]
    transition = torch.diag_embed(E_end.squeeze(-2)) - TI[..., :K]
    starts, S = _scan_states(transition, TI[..., K:], S0)
    return _WyChunks(A, QK, factors, L_inv, E, E_end, D, kEv, WU, Kd, transition, starts, S)


def _kda_chunk_core(q, k, v, g, beta, S0, cu_seqlens=None):
    """Scaled fp32/fp64 q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], S0 [B, H, K, V] -> (o, S_T).

    The chunk quantities come from `_wy_chunks`; then U = Ub - W S_n and O = (Q e^G) S_n + QK U for all chunks
    at once.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = _chunk_size(T)
    q, k, v, g = _to_chunks(T, C, q, k, v, g)  # [B, H, T/C, C, *]; padding: k = beta = 0, g = 0 (no write, no decay)
    (beta,) = _to_chunks(T, C, beta[..., None])  # [B, H, T/C, C, 1]
    N = q.shape[2]
    masks = None if cu_seqlens is None else doc_masks(cu_seqlens, B, T, C, q.dtype)
    ch = _wy_chunks(q, k, v, beta, g.cumsum(dim=-2), S0, masks)
    U = _baddbmm(ch.WU[..., K:], ch.WU[..., :K], ch.starts, alpha=-1.0)  # Ub - W S_n
    o = _baddbmm(_bmm(ch.QK, U), q * ch.E, ch.starts)  # [B, H, T/C, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, ch.S


def _kda_recurrent_core(q, k, v, g, beta, S):
    """The recurrent form (as the reference) on already-prepared tensors; used for single-token steps."""
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outputs, dim=1), S


def _kda_core(q, k, v, g, beta, S0, cu_seqlens=None):
    """With `cu_seqlens` S0 is zero (kda_chunk checks it), so a single token needs no reset."""
    if q.shape[1] <= RECURRENT_MAX_T:
        return _kda_recurrent_core(q, k, v, g, beta, S0)
    return _kda_chunk_core(q, k, v, g, beta, S0, cu_seqlens)


def _kda_chunk_backward(q, k, v, g, beta, S0, do, dS, cu_seqlens=None):
    """Hand-derived backward of `_kda_chunk_core` on the rebased path (`_rebase_is_safe`); q already scaled.

    Recomputes the forward's chunk quantities without autograd (`_wy_chunks`), walks the state recurrence backwards
    (dS_n = dStarts_n + transition_n^T dS_{n+1}, one batched matmul per chunk), then differentiates the WY solve
    (dR = L^-T dX, dL = -dR X^T, for X = [W | Ub] at once), the decay factors and the decayed products
    (`_rebased_adjoint`), and finally the cumulative sum G = cumsum(g). Returns dq (w.r.t. the scaled q), dk, dv,
    dg, dbeta [B, T, H], dS0, or None when the decays are too steep for the rebased factors (the caller then
    differentiates by recompute).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = _chunk_size(T)
    q, k, v, g, do = _to_chunks(T, C, q, k, v, g, do)  # [B, H, T/C, C, *]
    (beta,) = _to_chunks(T, C, beta[..., None])  # [B, H, T/C, C, 1]
    N = q.shape[2]
    G = g.cumsum(dim=-2)
    if not _rebase_is_safe(G):
        return None
    masks = None if cu_seqlens is None else doc_masks(cu_seqlens, B, T, C, q.dtype)
    ch = _wy_chunks(q, k, v, beta, G, S0, masks)
    W, Ub, starts = ch.WU[..., :K], ch.WU[..., K:], ch.starts
    U = _baddbmm(Ub, W, starts, alpha=-1.0)
    qE = q * ch.E
    # o = qE S_n + QK U,  U = Ub - W S_n
    dQK = _bmm(do, U.transpose(-1, -2)).tril()
    if masks is not None:  # the products between documents are constants (zero): no gradient reaches them
        dQK = dQK * masks.same
    dU = _bmm(ch.QK.transpose(-1, -2), do)
    dqE = _bmm(do, starts.transpose(-1, -2))
    dstarts = _baddbmm(_bmm(qE.transpose(-1, -2), do), W.transpose(-1, -2), dU, alpha=-1.0)  # [B, H, T/C, K, V]
    # S_{n+1} = transition_n S_n + inject_n, walked backwards from the final state's gradient
    dS_next = dS.reshape(B * H, K, V) if dS is not None else ch.S.new_zeros(B * H, K, V)
    dstarts_n, trans_n = dstarts.flatten(0, 1), ch.transition.flatten(0, 1).transpose(-1, -2)  # [B*H, T/C, *, *] views
    nexts = []
    for n in range(N - 1, -1, -1):
        nexts.append(dS_next)
        dS_next = torch.baddbmm(dstarts_n[:, n], trans_n[:, n], dS_next)
    dS0 = dS_next.view(B, H, K, V)
    dinject = torch.stack(nexts[::-1], dim=1).view(B, H, N, K, V)  # dS_{n+1}
    dtrans = _bmm(dinject, starts.transpose(-1, -2))  # [B, H, T/C, K, K]
    # TI = Kd^T [W | Ub] = [diag(E_end) - transition | inject]:  dTI = [-dtrans | dinject]
    dTI = torch.cat([-dtrans, dinject], dim=-1)  # [B, H, T/C, K, K+V]
    dKd = _bmm(ch.WU, dTI.transpose(-1, -2))  # [B, H, T/C, C, K]
    dWU = _bmm(ch.Kd, dTI)  # [dW | dUb] from TI, then from U = Ub - W S_n:
    dWU[..., :K] -= _bmm(dU, starts.transpose(-1, -2))
    dWU[..., K:] += dU
    # [W | Ub] = L^-1 diag(beta) kEv:  dR = L^-T d[W | Ub],  dL = -dR [W | Ub]^T (strictly lower)
    dR = _bmm(ch.L_inv.transpose(-1, -2), dWU)  # [B, H, T/C, C, K+V]
    dL = -_bmm(dR, ch.WU.transpose(-1, -2)).tril(-1)
    if masks is not None:
        dL = dL * masks.same
    dbeta = (dL * ch.A).sum(-1, keepdim=True) + (dR * ch.kEv).sum(-1, keepdim=True)
    dkEv = dR * beta
    dk_w, dv = dkEv[..., :K] * ch.E, dkEv[..., K:]  # kEv = [k E | v]
    KdKd = dKd * ch.Kd
    dG = dk_w * k - KdKd
    dG_end = KdKd.sum(dim=-2, keepdim=True) + torch.diagonal(dtrans, dim1=-2, dim2=-1)[..., None, :] * ch.E_end
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
    dq, dk, dv, dg, dbeta = _from_chunks(T, dq, dk, dv, dg, dbeta)
    return dq, dk, dv, dg, dbeta[..., 0], dS0


# The fast kernel as a custom op (opaque to torch.compile: `_kda_core` branches on the data). Backward
# recomputes: only the inputs are saved, so no per-chunk temporary (decay products, L^-1 solutions, per-chunk
# states) outlives the forward. Where the hand-written backward does not apply (single-token steps, decays too
# steep for sub-chunk rebasing) the chunked forward is recomputed under autograd and differentiated.
# q is saved unscaled (the caller's tensor, usually already kept by autograd) and scaled inside.
@torch.library.custom_op("glm53::kda_chunk", mutates_args=())
def _kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            S0: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    o, S = _kda_core(q * scale, k, v, g, beta, S0, cu_seqlens)
    return o.contiguous(), S.contiguous()  # the strides the fake implementation promises


@_kda_op.register_fake
def _(q, k, v, g, beta, S0, scale, cu_seqlens=None):
    return v.new_empty(v.shape), S0.new_empty(S0.shape)


@torch.library.custom_op("glm53::kda_chunk_backward", mutates_args=())
def _kda_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     S0: torch.Tensor, do: torch.Tensor, dS: torch.Tensor, scale: float,
                     cu_seqlens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    if q.shape[1] > RECURRENT_MAX_T:
        grads = _kda_chunk_backward(q * scale, k, v, g, beta, S0, do, dS, cu_seqlens)
        if grads is not None:  # None: decays too steep for the rebased factors
            dq, dk, dv, dg, dbeta, dS0 = grads
            return tuple(d.contiguous() for d in (dq * scale, dk, dv, dg, dbeta, dS0))
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, S0)]
    with autograd_inside_op():
        q, *rest = inputs
        o, S = _kda_core(q * scale, *rest, cu_seqlens)
        grads = torch.autograd.grad((o, S), inputs, (do, dS), allow_unused=True)
    return tuple(torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(inputs, grads))


@_kda_backward_op.register_fake
def _(q, k, v, g, beta, S0, do, dS, scale, cu_seqlens=None):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta, S0))


def _kda_setup(ctx, inputs, output) -> None:
    *tensors, ctx.scale, ctx.cu_seqlens = inputs
    ctx.save_for_backward(*tensors)


def _kda_backward(ctx, do, dS):
    q, k, v, g, beta, S0 = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.to(q.dtype)
    dS = torch.zeros_like(S0) if dS is None else dS
    return *_kda_backward_op(q, k, v, g, beta, S0, do, dS, ctx.scale, ctx.cu_seqlens), None, None


_kda_op.register_autograd(_kda_backward, setup_context=_kda_setup)


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fast eager form: all chunks at once, one batched matmul per chunk for the state; same signature.

    Computes in fp32 (fp64 when q is fp64, for tight gradient tests); backward by recompute (`_kda_op`).
    With `cu_seqlens` every row is chunked as without it and the documents are masked per chunk.
    """
    B, T, H, K = k.shape
    if cu_seqlens is not None:
        no_states(initial_state, output_final_state)
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T)
    V = v.shape[-1]
    dtype = compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    if initial_state is None:
        S0 = q.new_zeros(B, H, K, V, dtype=dtype)
    elif initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(B, H, K, V)}")
    else:
        S0 = initial_state.to(dtype)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype), S0)
    if T == 0:
        return v.new_zeros(v.shape, dtype=q.dtype), (S0 if output_final_state else None)
    o, S = _kda_op(*args, float(scale), cu_seqlens)
    return o.to(q.dtype), (S if output_final_state else None)


register("kda", "reference", kda_recurrent_reference)
register("kda", "chunk_reference", kda_chunk_reference)
register("kda", "fast", kda_chunk)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's form: eps inside the root, not a max)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


__all__ = ["kda_recurrent_reference", "kda_chunk_reference", "kda_chunk", "l2norm", "DEFAULT_CHUNK_SIZE"]
