"""KDA across sequence pieces: the delta-rule state is affine in the initial state, so a piece can be summarised
by two small matrices and pieces composed without running them in order (the basis of context parallelism).

Legend (glm53/model/__init__.py): B batch, T time, H heads, K key width, V value width.
One step is S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, so over a piece
    S_out = A S_in + Bs,   A [B, H, K, K] the product of the per-step matrices, Bs [B, H, K, V] the final state
from S_in = 0. Every column of S evolves with the same matrices, so ONE kernel call on the widened problem
(values [v | 0_K], initial state [0 | I_K]) returns [Bs | A] as its final state, and as its output
[o from a zero state | q_t^T A_t], so a piece's output from any S_in is o + (q_t^T A_t) S_in: one call of width
V + K runs a piece whose initial state is not known yet.
`kda_pieces` runs a sequence as `pieces` contiguous pieces this way (transitions, prefix composition, then each
piece from its own initial state): on one process it is the reference the context-parallel op is tested against,
and it equals the kernel on the whole sequence. `kda_sharded` is that op: this rank's piece, with the transitions
exchanged through a `SequenceShards` (glm53/model/context.py; `stack` is differentiable, so every rank's
gradient of its initial state flows back to the ranks before it).
Packed documents inside a piece (`starts` [B, T] bool, True at a document's first token): a piece holding a
start forgets its initial state from there on (its A is zero), so only the tokens before its first start read
the initial state, and its Bs is the state of its last document run from zero.
"""

from __future__ import annotations

import torch

from .chunk import kda_chunk


def _widened(q, k, v, g, beta, scale, kernel):
    """The widened call -> (o [B, T, H, V + K], A [B, H, K, K], Bs [B, H, K, V]): o[..., :V] is the output from
    a zero initial state, o[..., V:] the output's linear map of the initial state (q_t^T A_t, A_t the product
    of the step matrices up to t)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    widened = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [B, T, H, V + K]
    eye = torch.eye(K, dtype=dtype, device=q.device).expand(B, H, K, K)
    S0 = torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1)  # [B, H, K, V + K]
    o, S = kernel(q, k, widened, g, beta, scale=scale, initial_state=S0, output_final_state=True)
    return o, S[..., V:], S[..., :V]


def kda_transition(q, k, v, g, beta, *, scale: float | None = None, kernel=kda_chunk):
    """-> (A [B, H, K, K], Bs [B, H, K, V]) with final_state(S_in) = A @ S_in + Bs for every S_in (fp32)."""
    _, A, Bs = _widened(q, k, v, g, beta, scale, kernel)
    return A, Bs


def compose(A: torch.Tensor, Bs: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """A piece's final state from its initial state: A @ S_in + Bs ([B, H, K, V])."""
    return torch.matmul(A, S_in) + Bs


def prefix_states(As: list[torch.Tensor], Bss: list[torch.Tensor], S0: torch.Tensor) -> list[torch.Tensor]:
    """Initial state of every piece: S_in[0] = S0, S_in[r + 1] = A_r S_in[r] + Bs_r."""
    states = [S0]
    for A, Bs in zip(As[:-1], Bss[:-1]):
        states.append(compose(A, Bs, states[-1]))
    return states


def kda_pieces(
    q,
    k,
    v,
    g,
    beta,
    *,
    pieces: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    kernel=kda_chunk,
):
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


def kda_sharded(
    q,
    k,
    v,
    g,
    beta,
    shards,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    kernel=kda_chunk,
):
    """This rank's piece of a sequence split over `shards` (a SequenceShards) -> o [B, T, H, V] (T local).

    `initial_state` [B, H, K, V] is the whole sequence's, the same on every rank (each rank's gradient of it is
    its share: summed over the ranks they give the whole gradient); with packed documents, `starts`
    marks the document starts of this piece (True at position 0 when a document starts exactly there) and
    `cu_seqlens` holds them and the row starts over the flattened local tokens (kernels/varlen.py).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    S_in = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if starts is None:
        # one widened call: outputs [o from a zero state | q^T A_t] and final state [Bs | A] (see the module doc)
        o_wide, A, Bs = _widened(q, k, v, g, beta, scale, kernel)
    else:
        # keys zeroed before the last start: the state from zero stays zero up to it (Bs = last document's state)
        last = torch.where(starts, torch.arange(T, device=q.device), 0).amax(-1)  # [B]
        keep = (torch.arange(T, device=q.device)[None, :] >= last[:, None]).to(k.dtype)  # [B, T]
        A, Bs = kda_transition(q, k * keep[:, :, None, None], v, g, beta, scale=scale, kernel=kernel)
        A = A * (~starts.any(-1)).to(A.dtype)[:, None, None, None]
    As, Bss = shards.stack(A), shards.stack(Bs)  # [size, B, H, K, K], [size, B, H, K, V]
    for r in range(shards.rank):
        S_in = compose(As[r], Bss[r], S_in)
    if shards.rank == 0:  # every rank must run the stacks' backward (a collective), rank 0 with zero gradients
        S_in = S_in + 0 * (As.sum() + Bss.sum())
    if starts is None:  # o_t = o_t(zero state) + S_in^T A_t^T q_t
        return o_wide[..., :V] + torch.einsum("bthk,bhkv->bthv", o_wide[..., V:], S_in).to(o_wide.dtype)
    o = kernel(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)[0]  # every document from zero
    # plus what the initial state adds before the first start (linear: the same recurrence with zero values)
    carried = kernel(q, k, torch.zeros_like(v), g, beta, scale=scale, initial_state=S_in)[0]
    first = torch.where(starts, torch.arange(T, device=q.device), T).amin(-1)  # [B] (T: no start)
    before = (torch.arange(T, device=q.device)[None, :] < first[:, None]).to(o.dtype)
    return o + carried * before[:, :, None, None]


__all__ = ["kda_transition", "compose", "prefix_states", "kda_pieces", "kda_sharded"]
