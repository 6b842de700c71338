"""KDA across sequence pieces: the delta-rule state is affine in the initial state, so a piece can be summarised
by two small matrices and pieces composed without running them in order (the basis of context parallelism).

Legend (glm53/model/__init__.py): B batch, T time, H heads, K key width, V value width.
One step is S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, so over a piece
    S_out = A S_in + Bs,   A [B, H, K, K] the product of the per-step matrices, Bs [B, H, K, V] the final state
from S_in = 0. Every column of S evolves with the same matrices, so ONE kernel call on the widened problem
(values [v | 0_K], initial state [0 | I_K]) returns [Bs | A] as its final state.
`kda_pieces` runs a sequence as `pieces` contiguous pieces this way (transitions, prefix composition, then each
piece from its own initial state): on one process it is the reference the context-parallel op
(glm53/parallel/context.py) is tested against, and it equals the kernel on the whole sequence.
"""

from __future__ import annotations

import torch

from .chunk import kda_chunk


def kda_transition(q, k, v, g, beta, *, scale: float | None = None, kernel=kda_chunk):
    """-> (A [B, H, K, K], Bs [B, H, K, V]) with final_state(S_in) = A @ S_in + Bs for every S_in (fp32)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    widened = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [B, T, H, V + K]
    eye = torch.eye(K, dtype=dtype, device=q.device).expand(B, H, K, K)
    S0 = torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1)  # [B, H, K, V + K]
    _, S = kernel(q, k, widened, g, beta, scale=scale, initial_state=S0, output_final_state=True)
    return S[..., V:], S[..., :V]


def compose(A: torch.Tensor, Bs: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """A piece's final state from its initial state: A @ S_in + Bs ([B, H, K, V])."""
    return torch.matmul(A, S_in) + Bs


def prefix_states(As: list[torch.Tensor], Bss: list[torch.Tensor], S0: torch.Tensor) -> list[torch.Tensor]:
    """Initial state of every piece: S_in[0] = S0, S_in[r + 1] = A_r S_in[r] + Bs_r."""
    states = [S0]
    for A, Bs in zip(As[:-1], Bss[:-1]):
        states.append(compose(A, Bs, states[-1]))
    return states


def kda_pieces(q, k, v, g, beta, *, pieces: int, scale: float | None = None,
               initial_state: torch.Tensor | None = None, kernel=kda_chunk):  # fmt: skip
    """The sequence as `pieces` contiguous pieces composed through their transitions -> (o, final state)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    S0 = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    bounds = [T * r // pieces for r in range(pieces + 1)]
    parts = [[x[:, a:b] for x in (q, k, v, g, beta)] for a, b in zip(bounds[:-1], bounds[1:])]
    transitions = [kda_transition(*p, scale=scale, kernel=kernel) for p in parts]
    starts = prefix_states([t[0] for t in transitions], [t[1] for t in transitions], S0)
    outs = [kernel(*p, scale=scale, initial_state=s, output_final_state=False)[0] for p, s in zip(parts, starts)]
    final = compose(*transitions[-1], starts[-1])
    return torch.cat(outs, dim=1), final


__all__ = ["kda_transition", "compose", "prefix_states", "kda_pieces"]
