"""The dense attention mass per indexer pool: the statistic an MLA layer records for the indexer KL loss.

Legend (glm53/model/__init__.py): B batch, T time (queries), S keys, H heads, K query/key head width, P k-pools,
L tokens per pool, Tq a block of queries.
The model computes it (MultiHeadLatentAttention.forward with `ctx.stats.indexer`); the loss that reads it lives in
glm53/losses/parts.py (`indexer_kl_terms`). No gradient: it is the KL's target.
"""

from __future__ import annotations

import torch

from ..kernels.varlen import document_bounds
from .indexer import kept_pools

QUERY_CHUNK = 1024  # queries per block at most when computing the indexer loss's dense attention target
MASS_BUDGET = 1 << 24  # elements of one [B, H, Tq, S] block of that target's probabilities (64 MiB in fp32)
MIN_MASS_CHUNK = 16  # queries per block at least (bounds the loop's length at wide shapes)


@torch.no_grad()
def attention_pool_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    valid: torch.Tensor,
    kpool: int,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    query_offset: int = 0,
) -> torch.Tensor:
    """Dense causal attention probabilities summed over heads and within each pool: [B, T, P] fp32.

    q, k [B, T, H, K] (MLA queries and keys), valid [B, T] bool. The pools are the indexer's (`kept_pools`);
    mass on positions outside complete pools (the tail) lands in incomplete or invisible pools, which the
    candidate mask removes later. Restricting these dense probabilities to the selected pools and
    renormalising gives the sparse attention's own probabilities there (a softmax restricted to a subset).
    Context parallelism: q [B, Tq, H, K] are the queries at positions query_offset + [0, Tq) of the sequence
    that k [B, S, H, K], valid [B, S] and cu_seqlens (over B * S) describe; the result is [B, Tq, P].
    """
    B, T = valid.shape
    positions, _ = kept_pools(valid, kpool, cu_seqlens)  # [B, P, L]
    P = positions.shape[1]
    key_pos = torch.arange(T, device=q.device)
    doc_start = None if cu_seqlens is None else document_bounds(cu_seqlens, B, T)[0]  # packed: own document only
    Tq = q.shape[1]
    out = q.new_empty(B, Tq, P, dtype=torch.float32)
    step = _mass_chunk(B, q.shape[2], T)
    for start in range(0, Tq, step):  # bounds the [B, H, Tq, S] probabilities in memory
        lo, hi = query_offset + start, query_offset + min(start + step, Tq)  # the chunk's positions
        # causal: keys past the chunk's last query carry no mass, so the chunk reads keys [0, hi) only
        causal = key_pos[None, :hi] <= torch.arange(lo, hi, device=q.device)[:, None]
        visible = causal[None] & valid[:, None, :hi]  # [B, Tq, S']
        if doc_start is not None:
            visible &= key_pos[None, None, :hi] >= doc_start[:, lo:hi, None]
        qc = q[:, start : start + (hi - lo)]
        logits = torch.einsum("bthe,bshe->bhts", qc.float(), k[:, :hi].float()).mul_(scale)
        probs = logits.masked_fill_(~visible[:, None], float("-inf")).softmax(-1).nan_to_num_(0.0)
        del logits  # the softmax made a new tensor: one [B, H, Tq, S'] alive besides it at most
        token_mass = probs.sum(1)  # [B, Tq, S']: summed over heads
        in_chunk = (positions >= 0) & (positions < hi)  # pool tokens this chunk's queries may see
        index = positions.clamp(0, hi - 1).view(B, 1, -1).expand(B, hi - lo, -1)  # [B, Tq, P*L]
        gathered = token_mass.gather(-1, index) * in_chunk.view(B, 1, -1)
        out[:, start : start + (hi - lo)] = gathered.view(B, hi - lo, P, kpool).sum(-1)
    return out


def _mass_chunk(B: int, H: int, T: int) -> int:
    """Queries per chunk of the dense target: MASS_BUDGET probabilities, at least MIN_MASS_CHUNK queries and at
    most QUERY_CHUNK."""
    return max(1, min(QUERY_CHUNK, max(MIN_MASS_CHUNK, MASS_BUDGET // max(1, B * H * T))))


__all__ = ["attention_pool_mass"]
