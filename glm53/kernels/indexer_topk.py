"""The DSA indexer's pool choice fused with its scoring: each query's best `select` candidate pools.

Legend: B batch, T queries, H indexer heads, K head width, P pools, Tq a block of queries; `select` (this file's
extra) is how many pools a query picks, index_topk / L capped at P.
q: [B, T, H, K]; weights: [B, T, H] (already scaled by H^-0.5); pool_keys: [B, P, K]; pool_end: [B, P] position of
each pool's last token in the keys' sequence; complete: [B, P]. The queries sit at positions query_offset + [0, T).
A pool is a candidate for a query when it is complete and pool_end <= the query's position; packed documents add
pool_start [B, P] (row-local position of each pool's first token, kernels/varlen.py) and query_start [B, T] (the
row-local start of each query's document): a candidate also starts at or after its query's document start (a pool
never runs past its document's end, so it is then one of the query's own document). Scores are those of
kernels/indexer_scores.py; non-candidates score finfo.min and rank_pools (ties to the earliest pool) over the whole
row of P pools picks `select`. Returns (chosen pools [B, T, select] int64, whether each is a candidate [B, T, select]
bool).
The reference materialises the [B, T, P] scores (what Indexer.select reads in training). The fast form takes a
block of queries at a time: it scores only the pool columns [p0, p1) from the first to the last pool that is a
candidate of some query of the block (causal: on average half of them; packed: the pools of the block's documents)
and fills the rest of the block's [B, Tq, P] rows with finfo.min, so topk sees the reference's rows. The scores are
the same sums; a GEMM over fewer columns may round a last bit differently (at some shapes, not at the tested ones),
so the picks can differ only where two pools' scores at the selection boundary lie within that rounding, as between
indexer_scores and its reference. Memory: O(T * select + Tq * H * P), never a [B, T, P] tensor.
"""

from __future__ import annotations

import torch

from .budgets import budget
from .dispatch import register
from .indexer_scores import indexer_scores_reference
from .opaque import HOST_READING
from .varlen import document_bounds

TOPK_BUDGET = 1 << 20  # elements of one block's [B, Tq, H, P] logits (4 MiB in fp32: stays in cache)
MIN_TOPK_CHUNK = 16  # queries per block at least (bounds the loop's length at long T)


def _candidates(
    pool_end: torch.Tensor,
    complete: torch.Tensor,
    query_pos: torch.Tensor,
    pool_start: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """pool_end, complete [B, P], query_pos [Tq] -> [B, Tq, P] bool: complete and causally visible (packed, with
    pool_start [B, P] and the queries' document starts query_start [B, Tq]: and of the query's own document)."""
    candidate = (pool_end[:, None, :] <= query_pos[None, :, None]) & complete[:, None, :]
    if pool_start is not None:
        candidate &= pool_start[:, None, :] >= query_start[:, :, None]
    return candidate


def pool_starts(positions: torch.Tensor, T: int) -> torch.Tensor:
    """[B, P] position of each pool's first token from its valid token positions [B, P, L] (-1 invalid); T for a
    pool without a valid token (it belongs to no query's document)."""
    slot = torch.arange(positions.shape[-1], device=positions.device)
    return torch.where(positions >= 0, positions - slot, T).amin(-1)


def candidate_pools(
    positions: torch.Tensor,
    complete: torch.Tensor,
    S: int,
    cu_seqlens: torch.Tensor | None,
    query_offset: int,
    T: int,
) -> torch.Tensor:
    """[B, T, P] bool: the pools (token positions [B, P, L], -1 invalid; complete [B, P]) queries query_offset +
    [0, T) of a keys' sequence of S positions may pick: complete, causally visible, of the query's own document."""
    query_pos = torch.arange(query_offset, query_offset + T, device=positions.device)
    # Causal visibility from positions (s <= t; a complete pool's tokens are all valid), no [B, T, S] mask.
    pool_end = positions[..., -1].clamp(0, S - 1)
    if cu_seqlens is None:
        return _candidates(pool_end, complete, query_pos)  # [B, T, P]
    # ... and a pool of the query's own document (it starts at or after the document)
    return _candidates(pool_end, complete, query_pos, *document_starts(positions, cu_seqlens, S, query_offset, T))


def document_starts(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, S: int, query_offset: int, T: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed candidate rule's operands: each pool's first position pool_start [B, P] (from its token positions
    [B, P, L], -1 invalid) and the row-local document start query_start [B, T] of queries query_offset + [0, T) of
    the keys' sequence of S positions that `cu_seqlens` (over B * S) describes."""
    query_start = document_bounds(cu_seqlens, positions.shape[0], S)[0][:, query_offset : query_offset + T]
    return pool_starts(positions, S), query_start


def _check(q, pool_keys, pool_end, complete, select, pool_start, query_start) -> None:
    P = pool_keys.shape[1]
    if pool_end.shape != pool_keys.shape[:2] or complete.shape != pool_keys.shape[:2]:
        raise ValueError(
            f"indexer_topk_pools needs pool_end and complete of shape {tuple(pool_keys.shape[:2])}, got "
            f"{tuple(pool_end.shape)} and {tuple(complete.shape)}"
        )
    if not 0 <= select <= P:
        raise ValueError(f"indexer_topk_pools: select must be in [0, P={P}], got {select}")
    if (pool_start is None) != (query_start is None):
        raise ValueError("indexer_topk_pools: packed documents need both pool_start and query_start (or neither)")
    if pool_start is not None and (pool_start.shape != pool_keys.shape[:2] or query_start.shape != q.shape[:2]):
        raise ValueError(
            f"indexer_topk_pools needs pool_start of shape {tuple(pool_keys.shape[:2])} and query_start of shape "
            f"{tuple(q.shape[:2])}, got {tuple(pool_start.shape)} and {tuple(query_start.shape)}"
        )


def indexer_topk_pools_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    scale: float,
    pool_end: torch.Tensor,
    complete: torch.Tensor,
    query_offset: int,
    select: int,
    pool_start: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All queries at once: the [B, T, P] scores, masked to the candidates, then one topk."""
    _check(q, pool_keys, pool_end, complete, select, pool_start, query_start)
    scores = indexer_scores_reference(q, weights, pool_keys, scale)
    query_pos = torch.arange(query_offset, query_offset + q.shape[1], device=q.device)
    candidate = _candidates(pool_end, complete, query_pos, pool_start, query_start)
    chosen = rank_pools(scores.masked_fill(~candidate, torch.finfo(scores.dtype).min), select)
    return chosen, candidate.gather(-1, chosen)


def rank_pools(scores: torch.Tensor, select: int) -> torch.Tensor:
    """[..., P] scores -> the indices [..., select] of the best pools, ties to the earliest pool.

    The one tie rule of the indexer (full forward, packed, batched, cached decode and verify, compiled or eager):
    ReLU scores tie exactly (at 0 most often), and torch.topk's order among ties is unspecified and depends on P,
    so a stable descending sort decides instead. On tie-free scores it picks what torch.topk picks (transformers)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :select]


def topk_chunk(B: int, H: int, P: int, device: torch.device | str = "cpu") -> int:
    """Queries per block: TOPK_BUDGET logits, but at least MIN_TOPK_CHUNK queries (GPU-sized on CUDA, budgets.py)."""
    low, size = budget("min_topk_chunk", device, MIN_TOPK_CHUNK), budget("topk", device, TOPK_BUDGET)
    return max(low, size // max(1, B * H * P))


def _block_columns(
    pool_end: torch.Tensor,
    complete: torch.Tensor,
    last_pos: torch.Tensor,
    pool_start: torch.Tensor | None,
    query_start: torch.Tensor | None,
    step: int,
) -> list[tuple[int, int]]:
    """Per block of `step` queries, the pool columns [p0, p1) from the first to the last pool that is a candidate
    of some query of the block in some row (last_pos [n]: the block's last query position; packed: a pool starting
    at or after the block's earliest document start), all blocks in one host transfer before the loop. A block
    without a candidate gets p0 >= p1."""
    B, P = pool_end.shape
    reach = torch.where(complete, pool_end, torch.iinfo(pool_end.dtype).max)  # [B, P]
    seen = reach[:, None, :] <= last_pos[None, :, None]  # [B, n, P]
    if pool_start is not None:  # packed: and starting at or after the block's earliest document start, per row
        n, T = last_pos.shape[0], query_start.shape[1]
        last = query_start[:, -1:].expand(B, n * step - T)  # the last block's missing queries: its last one's
        lo = torch.cat([query_start, last], dim=1).view(B, n, step).amin(-1)  # [B, n]
        seen &= pool_start[:, None, :] >= lo[..., None]
    index = torch.arange(P, device=pool_end.device)
    p0 = torch.where(seen, index, P).amin(-1).amin(0)  # [n]
    p1 = torch.where(seen, index + 1, 0).amax(-1).amax(0)
    return torch.stack([p0, p1], dim=-1).tolist()  # NOTE: syncs (once per call, not per block)


def _topk_pools(
    q, weights, pool_keys, scale, pool_end, complete, query_offset, select, pool_start=None, query_start=None
):
    """The blocked form (see the module docstring); fp32 arithmetic even under autocast (the scores are fp32 by
    definition, and a bf16 GEMM result cannot hold the finfo(fp32).min fill)."""
    with torch.autocast(q.device.type, enabled=False):
        return _topk_pools_fp32(
            q, weights, pool_keys, scale, pool_end, complete, query_offset, select, pool_start, query_start
        )


def _topk_pools_fp32(q, weights, pool_keys, scale, pool_end, complete, query_offset, select, pool_start, query_start):
    _check(q, pool_keys, pool_end, complete, select, pool_start, query_start)
    B, T, H, _ = q.shape
    P = pool_keys.shape[1]
    chosen = q.new_zeros(B, T, select, dtype=torch.long)
    chosen_ok = q.new_zeros(B, T, select, dtype=torch.bool)
    if select == 0 or T == 0:
        return chosen, chosen_ok
    keys_t = pool_keys.float().transpose(-1, -2)  # [B, K, P]
    lowest = torch.finfo(torch.float32).min
    step = topk_chunk(B, H, P, q.device)
    starts = range(0, T, step)
    last_pos = torch.tensor([min(t0 + step, T) - 1 + query_offset for t0 in starts], device=q.device)
    columns = _block_columns(pool_end.long(), complete, last_pos, pool_start, query_start, step)
    for t0, (p0, p1) in zip(starts, columns):
        t1 = min(t0 + step, T)
        rows = torch.full((B, t1 - t0, P), lowest, device=q.device)  # [B, Tq, P]
        if p0 >= p1:  # no query of the block has a candidate
            chosen[:, t0:t1] = rank_pools(rows, select)
            continue
        # indexer_scores' arithmetic on the candidate columns only
        rows_q = q[:, t0:t1].float().reshape(B, (t1 - t0) * H, q.shape[-1])  # one GEMM: no per-query copy of the keys
        logits = torch.bmm(rows_q, keys_t[..., p0:p1]).mul_(scale).relu_().view(B, t1 - t0, H, p1 - p0)
        scores = torch.matmul(weights[:, t0:t1].float()[..., None, :], logits).squeeze(-2)  # [B, Tq, p1 - p0]
        query_pos = torch.arange(query_offset + t0, query_offset + t1, device=q.device)
        span = slice(p0, p1)
        packed = () if pool_start is None else (pool_start[:, span], query_start[:, t0:t1])
        candidate = _candidates(pool_end[:, span], complete[:, span], query_pos, *packed)
        rows[..., span] = scores.masked_fill_(~candidate, lowest)
        picked = rank_pools(rows, select)
        chosen[:, t0:t1] = picked
        inside = (picked >= p0) & (picked < p1)
        chosen_ok[:, t0:t1] = inside & candidate.gather(-1, (picked - p0).clamp(0, p1 - p0 - 1))
    return chosen, chosen_ok


# A custom op (kernels/opaque.py): torch.compile sees one call, not the block loop with its host sync.
@torch.library.custom_op("glm53::indexer_topk_pools", mutates_args=(), tags=HOST_READING)
def indexer_topk_pools(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    scale: float,
    pool_end: torch.Tensor,
    complete: torch.Tensor,
    query_offset: int,
    select: int,
    pool_start: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked over queries, scoring only the pools each block can see; same signature."""
    return _topk_pools(q, weights, pool_keys, scale, pool_end, complete, query_offset, select, pool_start, query_start)


@indexer_topk_pools.register_fake
def _(q, weights, pool_keys, scale, pool_end, complete, query_offset, select, pool_start=None, query_start=None):
    shape = (*q.shape[:2], select)
    return q.new_empty(shape, dtype=torch.long), q.new_empty(shape, dtype=torch.bool)


register("indexer_topk_pools", "reference", indexer_topk_pools_reference)
register("indexer_topk_pools", "fast", indexer_topk_pools)
