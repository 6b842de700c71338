"""The indexer KL target under tensor parallelism: completing the per-head sum of the attention pool mass.

Legend: B batch, T queries, P k-pools, L tokens per pool, J selected key slots per query (glm53/model/__init__.py).
Each TP rank holds some MLA heads, so the pool mass it records (`LayerStats.pool_mass` [B, T, P], training/
losses.py) is a partial sum over heads. The "dense" KL reads the mass at every candidate pool, so the whole
[B, T, P] is summed over the ranks. The "sparse" KL reads it only at the selected pools, and every selected pool's
tokens are among the layer's top-k slots: summing the mass gathered at the pools of those J slots, [B, T, J], is
enough (a pool appears once per token it owns, so L times: each copy is summed alike and written back alike). The
other entries stay partial sums, which the sparse target masks out.

Why the dense KL needs every pool's full sum (no O(T * J) reduction exists for it). Per query, with per-head
masses a_{h,c} and the candidate pools c (every complete pool of the query's document it can see, about T / L),
the target is t_c = m_c / Z with m_c = sum_h a_{h,c} and Z = sum_c m_c, and
KL(t || p) = sum_c t_c log t_c - sum_c t_c log p_c. Z and the cross-entropy term are linear in the a_{h,c}: each
rank could sum its own heads' share and only [B, T] would be reduced. The entropy term is not: t log t of a
head sum is no sum of per-head terms, so the loss value needs every m_c; and the student's gradient p_c - t_c
needs t_c at every candidate pool as well (per-rank partial cross-entropies would give it only if the replicated
indexer's gradients were summed over the TP ranks afterwards, and the reported KL would still lack the entropy).
So the dense path all-reduces the whole [B, T, P]. Memory: with the stored record the reduction runs in place on the
recorded mass, which the loss holds in full anyway (it reads every candidate), so it is one call. With the
recomputing record (the default, losses/indexer_kl.py) no [B, T, P] mass exists: each block of query rows' mass is
summed as the loss makes it (parallelize.py `_block_mass_reduce`), [B, Tq, J] slots when sparse (this file's
`sum_selected_pool_mass` on the block's rows), [B, Tq, P] when dense: the same bytes as above in total (twice: the
backward recomputes the blocks), O(Tq * P) memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..model.attention_mass import slot_pools


def sum_selected_pool_mass(
    pool_mass: torch.Tensor,
    topk: torch.Tensor,
    valid: torch.Tensor,
    kpool: int,
    cu_seqlens: torch.Tensor | None,
    all_reduce: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """The mass [B, T, P] with its entries at the pools of `topk`'s slots summed by `all_reduce` (in place, on a
    [B, T, J] tensor); returns a new [B, T, P] tensor."""
    P = pool_mass.shape[-1]
    pools = slot_pools(topk, valid, kpool, cu_seqlens, P)  # [B, T, J], P for an empty slot
    padded = F.pad(pool_mass, (0, 1))  # column P absorbs the empty slots
    compact = padded.gather(-1, pools)
    all_reduce(compact)
    return padded.scatter_(-1, pools, compact)[..., :P]


__all__ = ["slot_pools", "sum_selected_pool_mass"]
