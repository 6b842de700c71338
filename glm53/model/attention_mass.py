"""The dense attention mass per indexer pool: the statistic an MLA layer records for the indexer KL loss.

Legend (glm53/model/__init__.py): B batch, T time (queries), S keys, H heads, K query/key head width, P k-pools,
L tokens per pool, Tq a block of queries.
The model computes it (MultiHeadLatentAttention.forward with `ctx.stats.indexer`); the loss that reads it lives in
glm53/losses/parts.py (`indexer_kl_terms`). No gradient: it is the KL's target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    positions: torch.Tensor | None = None,
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
    if positions is None:  # given: the indexer's own layout (a packed one is wider when traced than eager)
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


def slot_pools(
    topk: torch.Tensor,
    valid: torch.Tensor,
    kpool: int,
    cu_seqlens: torch.Tensor | None = None,
    num_pools: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T, J] key positions (-1 empty) -> [B, T, J] index of the indexer pool holding each (P where none).
    `positions` [B, P, L]: the pools' layout when known (else rebuilt from valid and cu_seqlens).
    `num_pools`: the P of the mass this indexes; the layout rebuilt here must have the same width (a packed layout
    is narrower while compiling: both must come from the same mode, or the indices point at other pools).
    topk may be a block of query rows: only its slots are mapped."""
    if positions is None:
        positions, _ = kept_pools(valid, kpool, cu_seqlens)  # [B, P, L], -1 where invalid
    B, P, L = positions.shape
    if num_pools is not None and P != num_pools:
        raise RuntimeError(
            f"pool layout mismatch: the indexer's mass has {num_pools} pools per row, the layout "
            f"rebuilt for its reduction {P} (one traced, one eager?)"
        )
    T = valid.shape[1]
    pool_of = torch.full((B, T + 1), P, dtype=torch.long, device=topk.device)  # column T: empty slots
    ids = torch.arange(P, device=topk.device).repeat_interleave(L).expand(B, -1)
    pool_of.scatter_(1, torch.where(positions >= 0, positions, T).flatten(1), ids)
    pool_of[:, T] = P
    slots = torch.where((topk >= 0) & (topk < T), topk, T).long()
    return pool_of.gather(1, slots.flatten(1)).view_as(slots)


# ------------------------------------------------------------------ what the recomputing indexer KL records
@dataclass
class PoolMassInputs:
    """What one MLA layer records for the recomputing indexer KL (losses/indexer_kl.py) instead of its [B, T, P]
    pool mass: the inputs of `attention_pool_mass`, detached (the target has no gradient). O(T) memory.

    `reduce` (tensor parallelism, set by glm53/parallel): (a block's mass [B, Tq, P] from this rank's heads,
    its query rows' top-k [B, Tq, J]) -> that mass summed over the ranks wherever the loss reads it."""

    q: torch.Tensor  # [B, T, H, K] MLA queries
    k: torch.Tensor  # [B, T, H, K] MLA keys
    valid: torch.Tensor  # [B, T] bool: the keys' padding mask
    cu_seqlens: torch.Tensor | None
    kpool: int
    scale: float
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    offset: int = 0  # context parallelism: the queries' position in the keys' sequence (q holds rows offset + [0, T))

    def mass(self, t0: int, t1: int, topk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Query rows [t0, t1)'s pool mass [B, Tq, P] over the full indexer's pools `positions` [B, P, L] (its
        `topk` [B, T, J] for `reduce`)."""
        q = self.q[:, t0:t1]
        out = attention_pool_mass(
            q, self.k, self.valid, self.kpool, self.scale, self.cu_seqlens, self.offset + t0, positions
        )
        return out if self.reduce is None else self.reduce(out, topk[:, t0:t1])


@dataclass
class IndexerKlInputs:
    """What a full indexer layer records for the recomputing indexer KL instead of its [B, T, P] scores and masks:
    the indexer's queries, head weights and pool keys (with gradient to the indexer), the pool layout and the
    layer's top-k (the sparse KL's selected pools are the pools of its slots). O(T * J) memory."""

    q: torch.Tensor  # [B, T, H, K] indexer queries
    weights: torch.Tensor  # [B, T, H] fp32
    pool_keys: torch.Tensor  # [B, P, K]
    positions: torch.Tensor  # [B, P, L] pool token positions, -1 invalid
    complete: torch.Tensor  # [B, P]
    topk: torch.Tensor  # [B, T, J]
    valid: torch.Tensor  # [B, T] bool: the keys' padding mask
    cu_seqlens: torch.Tensor | None
    kpool: int
    scale: float
    offset: int = 0  # context parallelism: the queries' position in the keys' sequence (valid and topk: global)


__all__ = ["IndexerKlInputs", "PoolMassInputs", "attention_pool_mass", "slot_pools"]
