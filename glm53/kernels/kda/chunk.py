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

import torch

from ..dispatch import register
from ..opaque import HOST_READING, autograd_inside_op
from ..varlen import check_cu_seqlens
from .decay import rebase_is_static
from .fast import FAST_CHUNK_SIZE, kda_chunk_backward, kda_chunk_core, n_blocks  # noqa: F401 (re-export)
from .varlen import no_states, per_document

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
    gate_floor: float | None = None,  # a hint for the fast kernel (kda_chunk); the references ignore it
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule one token at a time: the definition every other form is tested against."""
    if cu_seqlens is not None:
        return per_document(
            kda_recurrent_reference, (q, k, v, g, beta), scale, initial_state, output_final_state, cu_seqlens
        )
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
    gate_floor: float | None = None,  # a hint for the fast kernel (kda_chunk); the references ignore it
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
# The blocked WY form and its hand-written backward live in fast.py; the intra-chunk decayed products in decay.py.
RECURRENT_MAX_T = 1  # single-token steps (decode) use the recurrent form directly


def _kda_recurrent_core(q, k, v, g, beta, S):
    """The recurrent form (as the reference) on already-prepared tensors; used for single-token steps."""
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outputs, dim=1), S


def _kda_core(q, k, v, g, beta, S0, cu_seqlens=None, static_rebase: bool = False):
    """-> (o, S_T, boundaries: the state at each block start, none for single-token steps). With `cu_seqlens` S0
    is zero (kda_chunk checks it), so a single token needs no reset."""
    if q.shape[1] <= RECURRENT_MAX_T:
        o, S = _kda_recurrent_core(q, k, v, g, beta, S0)
        return o, S, S0.new_empty(*S0.shape[:2], 0, *S0.shape[2:])
    return kda_chunk_core(q, k, v, g, beta, S0, cu_seqlens, static_rebase)


# The fast kernel as a custom op (opaque to torch.compile: `_kda_core` branches on the data). Backward
# recomputes: the inputs are saved, plus the state at each block start (`boundaries`, fast.py), so no per-chunk
# temporary (decay products, L^-1 solutions, per-chunk states) outlives the forward. Where the hand-written
# backward does not apply (single-token steps, decays too steep for sub-chunk rebasing) the chunked forward is
# recomputed under autograd and differentiated.
# q is saved unscaled (the caller's tensor, usually already kept by autograd) and scaled inside.
@torch.library.custom_op("glm53::kda_chunk", mutates_args=(), tags=HOST_READING)
def _kda_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S0: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    static_rebase: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o, S, boundaries = _kda_core(q * scale, k, v, g, beta, S0, cu_seqlens, static_rebase)
    return o.contiguous(), S.contiguous(), boundaries  # the strides the fake implementation promises


@_kda_op.register_fake
def _(q, k, v, g, beta, S0, scale, cu_seqlens=None, static_rebase=False):
    B, T, H, K = q.shape
    blocks = n_blocks(B, T, H, K, v.shape[-1], q.device) if T > RECURRENT_MAX_T else 0
    return v.new_empty(v.shape), S0.new_empty(S0.shape), S0.new_empty(*S0.shape[:2], blocks, *S0.shape[2:])


@torch.library.custom_op("glm53::kda_chunk_backward", mutates_args=(), tags=HOST_READING)
def _kda_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S0: torch.Tensor,
    boundaries: torch.Tensor,
    do: torch.Tensor,
    dS: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    static_rebase: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.shape[1] > RECURRENT_MAX_T:
        grads = kda_chunk_backward(q * scale, k, v, g, beta, do, dS, boundaries, cu_seqlens, static_rebase)
        if grads is not None:  # None: decays too steep for the rebased factors
            dq, dk, dv, dg, dbeta, dS0 = grads
            return tuple(d.contiguous() for d in (dq.mul_(scale), dk, dv, dg, dbeta, dS0))
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, S0)]
    with autograd_inside_op():
        q, *rest = inputs
        o, S, _ = _kda_core(q * scale, *rest, cu_seqlens)
        grads = torch.autograd.grad((o, S), inputs, (do, dS), allow_unused=True)
    return tuple(torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(inputs, grads))


@_kda_backward_op.register_fake
def _(q, k, v, g, beta, S0, boundaries, do, dS, scale, cu_seqlens=None, static_rebase=False):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta, S0))


def _kda_setup(ctx, inputs, output) -> None:
    *tensors, ctx.scale, ctx.cu_seqlens, ctx.static_rebase = inputs
    ctx.save_for_backward(*tensors, output[2])


def _kda_backward(ctx, do, dS, _dboundaries):
    q, k, v, g, beta, S0, boundaries = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.to(q.dtype)
    dS = torch.zeros_like(S0) if dS is None else dS
    grads = _kda_backward_op(q, k, v, g, beta, S0, boundaries, do, dS, ctx.scale, ctx.cu_seqlens, ctx.static_rebase)
    return *grads, None, None, None


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
    gate_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fast eager form: blocks of chunks at once, two batched matmuls per chunk for the state; same signature.

    Computes in fp32 (fp64 when q is fp64, for tight gradient tests); backward by recompute (`_kda_op`).
    With `cu_seqlens` every row is chunked as without it and the documents are masked per chunk.
    `gate_floor`: a lower bound the caller guarantees on g (the bounded gate's lower_bound). When it proves the
    sub-chunk rebasing safe (decay.rebase_is_static) no value of g is read; otherwise one reduction per call
    decides (a host sync per forward and per backward).
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
    o, S, _ = _kda_op(*args, float(scale), cu_seqlens, rebase_is_static(gate_floor))
    return o.to(q.dtype), (S if output_final_state else None)


register("kda", "reference", kda_recurrent_reference)
register("kda", "chunk_reference", kda_chunk_reference)
register("kda", "fast", kda_chunk)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's form: eps inside the root, not a max)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


__all__ = ["kda_recurrent_reference", "kda_chunk_reference", "kda_chunk", "l2norm", "DEFAULT_CHUNK_SIZE"]
