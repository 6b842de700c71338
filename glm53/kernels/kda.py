"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel forget gate.

Legend: B batch, T time, H heads, K key width, V value width, C chunk length, N = T / C chunks.

Conventions (shared by every implementation in this file, same signature):
- q, k: [B, T, H, K], already L2-normalised by the caller; `scale` multiplies q (default K^-0.5).
- v: [B, T, H, V].
- g: [B, T, H, K] log-space decay (g <= 0): the state is multiplied by exp(g_t) before step t writes.
- beta: [B, T, H] write strength in (0, 1).
- initial_state / final state: [B, H, K, V], fp32.
Per step:  S_t = diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = S_t^T (scale q_t).
All arithmetic is fp32; o is returned in q's dtype and the state in fp32.
"""

from __future__ import annotations

import torch

from .dispatch import register

DEFAULT_CHUNK_SIZE = 64


def _prepare(q, k, v, g, beta, scale, initial_state):
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if initial_state is None:
        state = q.new_zeros(B, H, K, V)
    else:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(B, H, K, V)}")
        state = initial_state.float()
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule one token at a time: the definition every other form is tested against."""
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
        system = torch.eye(n, device=q.device) + bc[..., None] * kk
        rhs = bc[..., None] * (vc - (kc * G.exp()) @ S)
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, n, V]
        qk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", qc, kc, decay)
        outputs.append(((qc * G.exp()) @ S + qk @ U).transpose(1, 2))
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        S = S * G_end.transpose(-1, -2).exp() + (kc * (G_end - G).exp()).transpose(-1, -2) @ U
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), (S if output_final_state else None)


register("kda", "reference", kda_recurrent_reference)
register("kda", "chunk", kda_chunk_reference)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's form: eps inside the root, not a max)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


__all__ = ["kda_recurrent_reference", "kda_chunk_reference", "l2norm", "DEFAULT_CHUNK_SIZE"]
