"""KDA's recurrent form as a kernel for short inputs (decode and verify steps): every state it passes through.

Legend: B batch, T time (a few tokens), H heads, K key width, V value width.
Conventions as kernels/kda/chunk.py (q, k L2-normalised by the caller; g <= 0 a log-space decay; fp32, fp64 for
fp64 inputs). Returns o [B, T, H, V] in q's dtype and the state after every token [B, T, H, K, V] (the last is
the final state; the others are what a speculative rewind returns to). A loop of T steps with no host read and
no data-dependent shape, so torch.compile unrolls it into one graph. The prefill takes the chunked kernel ("kda");
a caller chooses this one explicitly for short inputs (model/kda.py).
"""

from __future__ import annotations

import torch

from ..dispatch import register
from .chunk import _prepare, kda_recurrent_reference


def kda_recurrent_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token, keeping each state: S_t = diag(exp(g_t)) S_{t-1} + k_t u_t^T."""
    out_dtype = q.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    outputs, states = [], []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]  # [B, H, K, V]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        states.append(S)
    return torch.stack(outputs, dim=1).to(out_dtype), torch.stack(states, dim=1)


def kda_recurrent_states_reference(q, k, v, g, beta, *, scale=None, initial_state=None):
    """The definition (kda_recurrent_reference) run one token at a time, keeping each final state."""
    outputs, states, S = [], [], initial_state
    for t in range(q.shape[1]):
        o, S = kda_recurrent_reference(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            scale=scale,
            initial_state=S,
            output_final_state=True,
        )
        outputs.append(o)
        states.append(S)
    return torch.cat(outputs, dim=1), torch.stack(states, dim=1)


register("kda_recurrent", "reference", kda_recurrent_states_reference)
register("kda_recurrent", "fast", kda_recurrent_states)
