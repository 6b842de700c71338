"""The indexer's choice of key slots from its pool scores (model/indexer.py scores them): which pools are candidates
and kept, the chosen pools' tokens plus the visible incomplete tail, the same on a generation cache's time axis, and
the custom ops that make the choice at the torch.compile boundary.

Legend (glm53/model/__init__.py): B batch, T time (queries), S keys, P pools, L = kpool tokens per pool, J output
slots (index_topk, + L - 1 with the tail), -1 an empty slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import kernel_op
from ..kernels.indexer_topk import candidate_pools, document_starts, rank_pools
from ..kernels.opaque import HOST_READING
from ..kernels.varlen import document_bounds
from .packing import first_valid_in_document

indexer_topk_pools = kernel_op("indexer_topk_pools")


def first_valid_position(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B] index of the first True (T for an all-False row)."""
    T = valid.shape[-1]
    return torch.where(valid.any(-1), valid.long().argmax(-1), torch.full_like(valid[:, 0], T, dtype=torch.long))


def kept_pool_index(complete: torch.Tensor) -> torch.Tensor:
    """complete [B, P] -> [P'] indices of the pools complete in some row: transformers' pool axis."""
    return torch.nonzero(complete.any(0)).squeeze(1)  # NOTE: syncs (once per call)


def slot_count(index_topk: int, kpool: int, select_tail: bool) -> int:
    """J: the index_topk slots of the chosen pools, plus the L - 1 of the visible tail when it is selected."""
    return index_topk + (kpool - 1 if select_tail else 0)


def select_kept(
    scores: torch.Tensor,
    positions: torch.Tensor,
    complete: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    query_offset: int,
    index_topk: int,
    kpool: int,
    select_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Indexer.select` over pools that are all complete in some row (transformers' pool axis)."""
    num_slots = slot_count(index_topk, kpool, select_tail)
    S = valid.shape[1]
    T = scores.shape[1]
    candidate = candidate_pools(positions, complete, S, cu_seqlens, query_offset, T)  # [B, T, P]
    scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
    chosen = rank_pools(scores, min(index_topk // kpool, scores.shape[-1]))  # [B, T, select]
    chosen_ok = candidate.gather(-1, chosen)
    selected = torch.zeros_like(candidate).scatter_(-1, chosen, chosen_ok)
    topk = pool_slots(chosen, chosen_ok, positions, valid, cu_seqlens, query_offset, kpool, select_tail, num_slots)
    return topk, candidate, selected


def cached_slots(
    scores: torch.Tensor,
    first: torch.Tensor,
    query_pos: torch.Tensor,
    kpool: int,
    index_topk: int,
    select_tail: bool,
    num_slots: int,
) -> torch.Tensor:
    """`select_kept` on a generation cache's time axis: scores [B, T, P] of every cached pool (pool p of row b holds
    positions first_b + pL .. first_b + pL + L - 1), queries at query_pos [T] -> top-k [B, T, J]. No host read."""
    B, T, P = scores.shape
    count = query_pos[None, :] - first[:, None] + 1  # [B, T] the row's tokens up to each query (<= 0: padding)
    complete = count.clamp(min=0).div(kpool, rounding_mode="floor")  # [B, T] pools complete and visible
    candidate = torch.arange(P, device=scores.device) < complete[..., None]  # [B, T, P]
    scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
    chosen = rank_pools(scores, min(index_topk // kpool, P))  # [B, T, select]
    return cached_tokens(chosen, candidate.gather(-1, chosen), first, query_pos, kpool, select_tail, num_slots)


def cached_tokens(
    chosen: torch.Tensor,
    chosen_ok: torch.Tensor,
    first: torch.Tensor,
    query_pos: torch.Tensor,
    kpool: int,
    select_tail: bool,
    num_slots: int,
) -> torch.Tensor:
    """Chosen cached pools [B, T, select] (chosen_ok: a candidate) -> their tokens, then the visible tail, on the
    cache's time axis (`cached_slots`): top-k [B, T, J]."""
    L = kpool
    count = query_pos[None, :] - first[:, None] + 1  # [B, T] the row's tokens up to each query (<= 0: padding)
    complete = count.clamp(min=0).div(L, rounding_mode="floor")  # [B, T] pools complete and visible
    offsets = torch.arange(L, device=chosen.device)
    tokens = first[:, None, None, None] + chosen[..., None] * L + offsets  # [B, T, select, L]
    topk = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)
    if select_tail:  # the query's own incomplete pool, up to the query
        tail = (first[:, None] + complete * L)[..., None] + offsets[: L - 1]  # [B, T, L-1]
        topk = torch.cat([topk, tail.masked_fill(tail > query_pos[None, :, None], -1)], dim=-1)
    topk = F.pad(topk, (0, num_slots - topk.shape[-1]), value=-1)[..., :num_slots]
    return topk.masked_fill((count <= 0)[..., None], -1)


def pool_slots(
    chosen: torch.Tensor,
    chosen_ok: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    query_offset: int,
    kpool: int,
    select_tail: bool,
    num_slots: int,
) -> torch.Tensor:
    """Chosen pools [B, T, select] (chosen_ok: a candidate) -> their tokens, then the visible tail: [B, T, J]."""
    B, T = chosen.shape[:2]
    tokens = positions[torch.arange(B, device=chosen.device)[:, None, None], chosen]  # [B, T, select, L]
    topk = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)
    if select_tail:
        topk = torch.cat([topk, visible_tail(valid, kpool, cu_seqlens, query_offset, T)], dim=-1)
    topk = F.pad(topk, (0, num_slots - topk.shape[-1]), value=-1)[..., :num_slots]
    return topk.masked_fill(~valid[:, query_offset : query_offset + T, None], -1)


def visible_tail(
    valid: torch.Tensor,
    kpool: int,
    cu_seqlens: torch.Tensor | None = None,
    query_offset: int = 0,
    num_queries: int | None = None,
) -> torch.Tensor:
    """`Indexer.visible_tail` for pools of `kpool` tokens."""
    B, S = valid.shape
    T = S - query_offset if num_queries is None else num_queries
    width = kpool - 1
    if width == 0:
        return valid.new_empty(B, T, 0, dtype=torch.long)
    rows = slice(query_offset, query_offset + T)
    count = valid.long().cumsum(-1)  # [B, S] visible (valid, causal) tokens per query
    origin = first_valid_position(valid)[:, None]  # where the query's pools start
    if cu_seqlens is not None:  # count only the query's own document
        doc_start = document_bounds(cu_seqlens, B, S)[0]
        count = count - torch.cat([count.new_zeros(B, 1), count], dim=1).gather(1, doc_start)
        origin = first_valid_in_document(valid, cu_seqlens)[:, rows]
    count = count[:, rows]  # [B, T]
    tail = count.remainder(kpool)
    offsets = torch.arange(width, device=valid.device)
    start = origin + count - tail
    idx = start[..., None] + offsets  # [B, T, L-1]
    query_pos = torch.arange(query_offset, query_offset + T, device=valid.device)[None, :, None]
    safe = idx.clamp(0, S - 1)
    ok = (offsets < tail[..., None]) & (idx < S) & (idx <= query_pos)
    ok = ok & valid.gather(-1, safe.flatten(1)).view_as(safe)
    return idx.masked_fill(~ok, -1)


# ---------------------------------------------------------------------------------------- torch.compile boundary
# Which pools transformers ranks depends on the data (those complete in some row), and torch.topk's order among
# tied scores (ReLU scores tie at 0 often) depends on how many it ranks: the choice runs as a custom op that
# drops those pools eagerly, so compiled and eager models pick the same keys, with fixed-size outputs for
# torch.compile. Nothing here has a gradient (the selection is made from detached scores).
@torch.library.custom_op("glm53::select_pools", mutates_args=(), tags=HOST_READING)
def select_pools(
    scores: torch.Tensor,
    positions: torch.Tensor,
    complete: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    query_offset: int,
    index_topk: int,
    kpool: int,
    select_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [B, T, P], positions [B, P, L], complete [B, P], valid [B, S] -> (top-k [B, T, J], candidate pools
    [B, T, P], selected pools [B, T, P]); pools incomplete in every row are neither."""
    kept = kept_pool_index(complete)
    topk, kept_candidate, kept_selected = select_kept(
        scores.index_select(-1, kept),
        positions.index_select(1, kept),
        complete.index_select(1, kept),
        valid,
        cu_seqlens,
        query_offset,
        index_topk,
        kpool,
        select_tail,
    )
    candidate = kept_candidate.new_zeros(scores.shape).index_copy_(-1, kept, kept_candidate)
    selected = kept_selected.new_zeros(scores.shape).index_copy_(-1, kept, kept_selected)
    return topk, candidate, selected


@select_pools.register_fake
def _(scores, positions, complete, valid, cu_seqlens, query_offset, index_topk, kpool, select_tail):
    num_slots = slot_count(index_topk, kpool, select_tail)
    mask = scores.new_empty(scores.shape, dtype=torch.bool)
    return scores.new_empty(*scores.shape[:2], num_slots, dtype=torch.long), mask, mask.clone()


@torch.library.custom_op("glm53::select_pools_blocked", mutates_args=(), tags=HOST_READING)
def select_pools_blocked(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    positions: torch.Tensor,
    complete: torch.Tensor,
    valid: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    query_offset: int,
    index_topk: int,
    kpool: int,
    select_tail: bool,
) -> torch.Tensor:
    """`select_pools`' top-k [B, T, J] scored and chosen a block of queries at a time (kernel "indexer_topk_pools"):
    q [B, T, H, K], weights [B, T, H], pool_keys [B, P, K], positions [B, P, L], complete [B, P], valid [B, S],
    `cu_seqlens` (over B * S) the keys' documents or None. Eager and compiled forwards alike: no [B, T, P] scores
    (packed: the candidates of a block of queries are the pools of its documents, from the document bounds)."""
    kept = kept_pool_index(complete)
    pool_keys, positions, complete = (t.index_select(1, kept) for t in (pool_keys, positions, complete))
    S, T = valid.shape[1], q.shape[1]
    pool_end = positions[..., -1].clamp(0, S - 1)  # [B, P] as `select` reads it
    packed = () if cu_seqlens is None else document_starts(positions, cu_seqlens, S, query_offset, T)
    select = min(index_topk // kpool, pool_keys.shape[1])
    chosen, chosen_ok = indexer_topk_pools(
        q, weights, pool_keys, scale, pool_end, complete, query_offset, select, *packed
    )
    num_slots = slot_count(index_topk, kpool, select_tail)
    return pool_slots(chosen, chosen_ok, positions, valid, cu_seqlens, query_offset, kpool, select_tail, num_slots)


@select_pools_blocked.register_fake
def _(
    q, weights, pool_keys, positions, complete, valid, cu_seqlens, scale, query_offset, index_topk, kpool, select_tail
):
    return q.new_empty(*q.shape[:2], slot_count(index_topk, kpool, select_tail), dtype=torch.long)
