"""DSA indexer scores against pooled keys: score(t, p) = sum_h w_h(t) * relu(q_h(t) . key_p * scale).

Legend: B batch, T queries, H indexer heads, K head width, P pools, Tq a block of queries.
q: [B, T, H, K]; weights: [B, T, H] (already scaled by H^-0.5); pool_keys: [B, P, K]. Returns [B, T, P] fp32.
The ReLU sits between the head contraction and the head sum, so the [T, H, P] logits cannot be factorised away;
the fast form only bounds how many of them exist at once.
Packed documents (`cu_seqlens` over the flattened B * T tokens, kernels/varlen.py, with `pool_start` [B, P], the
row-local position of each pool's first token, >= T for an empty slot, non-decreasing along P): a query scores
only the pools that start inside its own document; every other score is 0 (the indexer masks them anyway). The
reference runs each document alone; the fast form computes, per chunk of queries, only the pool columns its
documents own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .budgets import budget
from .dispatch import register
from .opaque import HOST_READING
from .varlen import check_cu_seqlens, document_bounds, document_slices, own_document_pools

SCORE_BUDGET = 1 << 20  # elements of one [B, Tq, H, P] logits chunk (4 MiB in fp32: stays in cache)
MIN_PACKED_CHUNK = 64  # queries per chunk at least when packed (short documents share a chunk)
MIN_SCORE_CHUNK = 64  # queries per chunk at least (bounds the loop's length at long T)


def _check_packed(q: torch.Tensor, pool_keys: torch.Tensor, cu_seqlens, pool_start) -> torch.Tensor:
    if pool_start is None or pool_start.shape != pool_keys.shape[:2]:
        raise ValueError(
            f"indexer_scores with cu_seqlens needs pool_start of shape {tuple(pool_keys.shape[:2])}, "
            f"got {None if pool_start is None else tuple(pool_start.shape)}"
        )
    return check_cu_seqlens(cu_seqlens, *q.shape[:2])


def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
    pool_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """All queries at once: materialises the [B, T, H, P] logits (with `cu_seqlens`: one document at a time)."""
    if cu_seqlens is not None:
        cu = _check_packed(q, pool_keys, cu_seqlens, pool_start)
        out = q.new_zeros(*q.shape[:2], pool_keys.shape[1], dtype=torch.float32)
        for b, s, e in document_slices(cu, q.shape[1]):
            own = ((pool_start[b] >= s) & (pool_start[b] < e)).nonzero().flatten()
            if own.numel():
                part = indexer_scores_reference(
                    q[b : b + 1, s:e], weights[b : b + 1, s:e], pool_keys[b : b + 1, own], scale
                )
                out[b, s:e, own] = part[0]
        return out
    logits = torch.matmul(q.float(), pool_keys.float().transpose(-1, -2)[:, None])  # [B, T, H, P]
    logits = F.relu(logits * scale)
    return torch.matmul(weights.float()[..., None, :], logits).squeeze(-2)


def _packed_scores(q, weights, pool_keys, scale, cu, pool_start):
    """Chunks of queries against the pool columns their documents own, masked to each query's document."""
    B, T, H, _ = q.shape
    P = pool_keys.shape[1]
    start, end = document_bounds(cu, B, T)
    longest = int((end - start).max())  # NOTE: syncs
    step = max(1, min(budget("score", q.device, SCORE_BUDGET) // max(1, B * H * P), max(MIN_PACKED_CHUNK, longest)))
    keys_t = pool_keys.float().transpose(-1, -2)[:, None]  # [B, 1, E, P]
    out = q.new_zeros(B, T, P, dtype=torch.float32)
    for t0, (p0, p1) in zip(range(0, T, step), _owned_pools(start, end, pool_start, step)):
        if p0 >= p1:
            continue
        t1 = min(t0 + step, T)
        s_c, e_c = start[:, t0:t1, None], end[:, t0:t1, None]  # [B, Tq, 1]
        logits = F.relu(torch.matmul(q[:, t0:t1].float(), keys_t[..., p0:p1]) * scale)  # [B, Tq, H, p]
        scores = torch.matmul(weights[:, t0:t1].float()[..., None, :], logits).squeeze(-2)
        columns = pool_start[:, None, p0:p1]
        out[:, t0:t1, p0:p1] = scores * ((columns >= s_c) & (columns < e_c))
    return out


def _owned_pools(start, end, pool_start, step) -> list[tuple[int, int]]:
    """Per chunk of `step` queries, the pool columns [p0, p1) starting inside the chunk's documents (any row),
    for all chunks in one host transfer before the loop. start, end [B, T] document bounds; pool_start [B, P]
    non-decreasing along P."""
    B, T = start.shape
    n = -(-T // step)
    pad = n * step - T
    lo = F.pad(start, (0, pad), value=T).view(B, n, step).amin(-1)  # [B, n]: earliest document start
    hi = F.pad(end, (0, pad), value=0).view(B, n, step).amax(-1)  # [B, n]: latest document end
    seq = pool_start.contiguous()
    p0 = torch.searchsorted(seq, lo.contiguous())  # first pool starting at or after lo, per row
    p1 = torch.searchsorted(seq, hi.contiguous())  # first pool starting at or after hi
    P = pool_start.shape[1]
    p0, p1 = torch.where(p0 < p1, p0, P).amin(0), torch.where(p0 < p1, p1, 0).amax(0)
    return torch.stack([p0, p1], dim=-1).tolist()  # NOTE: syncs (once per call, not per chunk)


def _score_chunk(B: int, H: int, P: int, device: torch.device | str = "cpu") -> int:
    """Queries per chunk: SCORE_BUDGET logits, but at least MIN_SCORE_CHUNK queries (at long T one query's [H, P]
    logits alone approach the budget; MIN_SCORE_CHUNK of them stay below the [T, P] output's own size)."""
    low, size = budget("min_score_chunk", device, MIN_SCORE_CHUNK), budget("score", device, SCORE_BUDGET)
    return max(low, size // max(1, B * H * P))


def _scores_forward(q, weights, pool_keys, scale):
    """[B, T, P] fp32, one chunk of queries at a time, contiguous."""
    B, T, H, _ = q.shape
    P = pool_keys.shape[1]
    keys_t = pool_keys.float().transpose(-1, -2)[:, None]  # [B, 1, K, P]
    out = q.new_empty(B, T, P, dtype=torch.float32)
    step = _score_chunk(B, H, P, q.device)
    for start in range(0, T, step):
        end = min(start + step, T)
        logits = F.relu(torch.matmul(q[:, start:end].float(), keys_t) * scale)  # [B, Tq, H, P]
        out[:, start:end] = torch.matmul(weights[:, start:end].float()[..., None, :], logits).squeeze(-2)
    return out


def _scores_backward(q, weights, pool_keys, d_out, scale):
    """-> (dq, dweights, dpool_keys) in the inputs' dtypes: each chunk's logits recomputed, never all saved.
    With a = q_h . key_p * scale: d weights_h = sum_p d_out_p relu(a); d a = d_out_p weights_h [a > 0]."""
    B, T, H, K = q.shape
    P = pool_keys.shape[1]
    keys = pool_keys.float()  # [B, P, K]
    keys_t = keys.transpose(-1, -2)[:, None]  # [B, 1, K, P]
    dq, dw = q.new_empty(B, T, H, K, dtype=torch.float32), q.new_empty(B, T, H, dtype=torch.float32)
    dkeys = keys.new_zeros(B, P, K)
    step = _score_chunk(B, H, P, q.device)
    for start in range(0, T, step):
        end = min(start + step, T)
        q_c, w_c, g_c = q[:, start:end].float(), weights[:, start:end].float(), d_out[:, start:end].float()
        a = torch.matmul(q_c, keys_t) * scale  # [B, Tq, H, P]
        dw[:, start:end] = torch.matmul(F.relu(a), g_c[..., None]).squeeze(-1)
        da = (g_c[:, :, None, :] * w_c[..., None]).masked_fill_(a <= 0, 0.0).mul_(scale)  # [B, Tq, H, P]
        # one GEMM over the chunk's (query, head) rows: a broadcast matmul would copy the keys once per query
        dq[:, start:end] = torch.bmm(da.view(B, (end - start) * H, P), keys).view(B, end - start, H, K)
        dkeys += torch.matmul(da.flatten(1, 2).transpose(-1, -2), q_c.flatten(1, 2))  # [B, P, K]
    return dq.to(q.dtype), dw.to(weights.dtype), dkeys.to(pool_keys.dtype)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
    pool_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same, one chunk of queries at a time, forward and (recomputing) backward: never more than one chunk's
    logits alive, in training too; same signature."""
    if cu_seqlens is not None:
        return _packed_op(q, weights, pool_keys, scale, _check_packed(q, pool_keys, cu_seqlens, pool_start), pool_start)
    return _scores_op(q, weights, pool_keys, scale)


# A custom op (kernels/opaque.py) so that torch.compile sees one call, not T / chunk unrolled iterations, and the
# hand-written, recomputing backward replaces autograd's saved [B, T, H, P] logits.
@torch.library.custom_op("glm53::indexer_scores", mutates_args=())
def _scores_op(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, scale: float) -> torch.Tensor:
    return _scores_forward(q, weights, pool_keys, scale)


@_scores_op.register_fake
def _(q, weights, pool_keys, scale):
    return q.new_empty(*q.shape[:2], pool_keys.shape[1], dtype=torch.float32)


@torch.library.custom_op("glm53::indexer_scores_backward", mutates_args=())
def _scores_backward_op(
    q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, d_out: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _scores_backward(q, weights, pool_keys, d_out, scale)


@_scores_backward_op.register_fake
def _(q, weights, pool_keys, d_out, scale):
    return q.new_empty(q.shape), weights.new_empty(weights.shape), pool_keys.new_empty(pool_keys.shape)


def _scores_setup(ctx, inputs, output) -> None:
    q, weights, pool_keys, ctx.scale = inputs
    ctx.save_for_backward(q, weights, pool_keys)


def _scores_grad(ctx, d_out):
    return (*_scores_backward_op(*ctx.saved_tensors, d_out, ctx.scale), None)


_scores_op.register_autograd(_scores_grad, setup_context=_scores_setup)


# The packed form too (its chunks' pool spans are read on the host). The packed scores are the plain ones times
# a constant mask (a pool of the query's own document), so the backward is the plain one on the masked gradient.
@torch.library.custom_op("glm53::indexer_scores_packed", mutates_args=(), tags=HOST_READING)
def _packed_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    pool_start: torch.Tensor,
) -> torch.Tensor:
    return _packed_scores(q, weights, pool_keys, scale, cu_seqlens, pool_start)


@_packed_op.register_fake
def _(q, weights, pool_keys, scale, cu_seqlens, pool_start):
    return q.new_empty(*q.shape[:2], pool_keys.shape[1], dtype=torch.float32)


@torch.library.custom_op("glm53::indexer_scores_packed_backward", mutates_args=(), tags=HOST_READING)
def _packed_backward_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool_keys: torch.Tensor,
    d_out: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    pool_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    own = own_document_pools(pool_start, cu_seqlens, q.shape[1], 0, q.shape[1])  # [B, T, P]
    return _scores_backward(q, weights, pool_keys, d_out * own, scale)


@_packed_backward_op.register_fake
def _(q, weights, pool_keys, d_out, scale, cu_seqlens, pool_start):
    return q.new_empty(q.shape), weights.new_empty(weights.shape), pool_keys.new_empty(pool_keys.shape)


def _packed_setup(ctx, inputs, output) -> None:
    q, weights, pool_keys, ctx.scale, cu_seqlens, pool_start = inputs
    ctx.save_for_backward(q, weights, pool_keys, cu_seqlens, pool_start)


def _packed_grad(ctx, d_out):
    q, weights, pool_keys, cu_seqlens, pool_start = ctx.saved_tensors
    return (*_packed_backward_op(q, weights, pool_keys, d_out, ctx.scale, cu_seqlens, pool_start), None, None, None)


_packed_op.register_autograd(_packed_grad, setup_context=_packed_setup)


register("indexer_scores", "reference", indexer_scores_reference)
register("indexer_scores", "fast", indexer_scores)
