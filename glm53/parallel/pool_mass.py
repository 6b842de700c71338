"""The indexer KL target under tensor parallelism: completing the per-head sum of the attention pool mass.

Legend: B batch, T queries, P k-pools, L tokens per pool, J selected key slots per query (glm53/model/__init__.py).
Each TP rank holds some MLA heads, so the pool mass it records (`LayerStats.pool_mass` [B, T, P], training/
losses.py) is a partial sum over heads. The "dense" KL reads the mass at every candidate pool, so the whole
[B, T, P] is summed over the ranks. The "sparse" KL reads it only at the selected pools, and every selected pool's
tokens are among the layer's top-k slots: summing the mass gathered at the pools of those J slots, [B, T, J], is
enough (a pool appears once per token it owns, so L times: each copy is summed alike and written back alike). The
other entries stay partial sums, which the sparse target masks out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..model.indexer import kept_pools


def slot_pools(topk: torch.Tensor, valid: torch.Tensor, kpool: int,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[B, T, J] key positions (-1 empty) -> [B, T, J] index of the indexer pool holding each (P where none)."""
    positions, _ = kept_pools(valid, kpool, cu_seqlens)  # [B, P, L], -1 where invalid
    B, P, L = positions.shape
    T = valid.shape[1]
    pool_of = torch.full((B, T + 1), P, dtype=torch.long, device=topk.device)  # column T: empty slots
    ids = torch.arange(P, device=topk.device).repeat_interleave(L).expand(B, -1)
    pool_of.scatter_(1, torch.where(positions >= 0, positions, T).flatten(1), ids)
    pool_of[:, T] = P
    slots = torch.where((topk >= 0) & (topk < T), topk, T).long()
    return pool_of.gather(1, slots.flatten(1)).view_as(slots)


def sum_selected_pool_mass(pool_mass: torch.Tensor, topk: torch.Tensor, valid: torch.Tensor, kpool: int,
                           cu_seqlens: torch.Tensor | None,
                           all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:  # fmt: skip
    """The mass [B, T, P] with its entries at the pools of `topk`'s slots summed by `all_reduce` (in place, on a
    [B, T, J] tensor); returns a new [B, T, P] tensor."""
    P = pool_mass.shape[-1]
    pools = slot_pools(topk, valid, kpool, cu_seqlens)  # [B, T, J], P for an empty slot
    padded = F.pad(pool_mass, (0, 1))  # column P absorbs the empty slots
    compact = padded.gather(-1, pools)
    all_reduce(compact)
    return padded.scatter_(-1, pools, compact)[..., :P]


__all__ = ["slot_pools", "sum_selected_pool_mass"]
