"""Top-k sparse attention: each query attends only to the key positions the DSA indexer selected.

Legend: B batch, T queries, S keys, H heads, K query/key width, V value width, J selected slots per query, Tq a
block of queries (the backward's locals call K and V D and E).
q: [B, T, H, K]; k: [B, S, H, K]; v: [B, S, H, V]; topk_indices: [B, T, J] integer key positions, -1 marks an
empty slot (a position appears at most once per row: the indexer selects disjoint pools and a disjoint tail).
Returns o [B, T, H, V] in q's dtype; softmax in fp32. A query whose slots are all empty (a padding row)
gets a zero output. (transformers' eager path gives such rows a uniform average over all keys instead;
they are padding, nothing downstream reads them.)
Packed documents (`cu_seqlens` over the flattened B * T tokens, kernels/varlen.py; keys are the queries' own
tokens, S = T): a query reads only selected keys of its own document; slots pointing elsewhere count as empty.
The references run each document alone; the fast forms drop the other documents' slots up front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .budgets import budget
from .dispatch import register
from .opaque import HOST_READING
from .varlen import check_cu_seqlens, document_bounds, document_slices


def topk_to_mask(topk_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, T, J] indices (-1 empty) -> [B, T, S] bool mask of selected keys."""
    valid = (topk_indices >= 0) & (topk_indices < num_keys)
    safe = topk_indices.long().clamp(0, num_keys - 1)
    counts = torch.zeros(*topk_indices.shape[:2], num_keys, dtype=torch.int32, device=topk_indices.device)
    counts.scatter_add_(-1, safe, valid.to(torch.int32))
    return counts > 0


def same_document_only(topk_indices: torch.Tensor, cu_seqlens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, T, J] indices with every slot outside the query's own document set to -1 (empty)."""
    B, T = topk_indices.shape[:2]
    if num_keys != T:
        raise ValueError(f"cu_seqlens needs keys that are the queries' own tokens (S == T), got S={num_keys}, T={T}")
    start, end = document_bounds(check_cu_seqlens(cu_seqlens, B, T), B, T)
    inside = (topk_indices >= start[..., None]) & (topk_indices < end[..., None])
    return topk_indices.masked_fill(~inside, -1)


def _per_document(attend, q, kvs, topk_indices, scale, cu_seqlens):
    """Run `attend` on each document alone (indices shifted to it, others empty) and put the outputs in place."""
    B, T = q.shape[:2]
    cu = check_cu_seqlens(cu_seqlens, B, T)
    o = torch.zeros_like(q) if len(kvs) == 1 else q.new_zeros(*q.shape[:-1], kvs[1].shape[-1])
    for b, s, e in document_slices(cu, T):
        idx = topk_indices[b : b + 1, s:e] - s
        idx = idx.masked_fill((idx < 0) | (idx >= e - s), -1)
        o[b : b + 1, s:e] = attend(q[b : b + 1, s:e], *(x[b : b + 1, s:e] for x in kvs), idx, scale)
    return o


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense scores over all S keys, masked to the selected set: O(T * S), the obviously-correct form."""
    if cu_seqlens is not None:
        return _per_document(sparse_attention_reference, q, (k, v), topk_indices, scale, cu_seqlens)
    mask = topk_to_mask(topk_indices, k.shape[1])  # [B, T, S]
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-empty rows -> 0
    return torch.einsum("bhts,bshe->bthe", probs, v.float()).to(q.dtype)


# ----------------------------------------------------------------------------------------------- per-head form
# Gather chunks: each query reads only its J selected keys, O(T * J) work (masked-dense chunks, further down, take
# the chunks whose selected keys lie in a short span). Queries are processed a chunk at a time. The chunk holds
# GATHER_BUDGET elements per gathered tensor when a query is small, and never fewer than MIN_QUERY_CHUNK queries
# when it is large (at the released widths one query's gathered keys alone exceed the budget): memory per chunk is
# then MIN_QUERY_CHUNK queries' worth whatever T is, and the number of Python iterations is T / MIN_QUERY_CHUNK at
# most, never one per query. The backward is written by hand (flash-attention style): it saves only q, k, v and the
# indices, recomputes each chunk's probabilities and scatters the key/value gradients with index_add_.
GATHER_BUDGET = 1 << 20  # elements of one gathered [B, H, Tq, J, K] chunk (4 MiB in fp32: stays in cache)
MIN_QUERY_CHUNK = 16  # queries per chunk at least (bounds the loop's length at wide shapes)


def _query_chunk(B: int, H: int, J: int, width: int, device: torch.device | str = "cpu") -> int:
    """Queries per chunk on `device` (kernels/budgets.py: the constants above on the CPU, GPU-sized on CUDA)."""
    low, size = budget("min_query_chunk", device, MIN_QUERY_CHUNK), budget("gather", device, GATHER_BUDGET)
    return max(low, size // max(1, B * H * J * width))


def _gather(x: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, K or V], safe [B, Tq, J] -> [B, H, Tq, J, K or V] (the selected rows, per head)."""
    B, H = x.shape[:2]
    b = torch.arange(B, device=x.device)[:, None, None, None]
    h = torch.arange(H, device=x.device)[None, :, None, None]
    return x[b, h, safe[:, None]]


def _chunk_probs(q_c, k_h, idx_c, scale):
    """q_c [B, H, Tq, K], k_h [B, H, S, K], idx_c [B, Tq, J] -> (probs [B, H, Tq, J], safe idx, gathered keys)."""
    S = k_h.shape[2]
    valid = (idx_c >= 0) & (idx_c < S)
    safe = idx_c.long().clamp(0, S - 1)
    k_g = _gather(k_h, safe)
    scores = (k_g @ q_c[..., None]).squeeze(-1) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0), safe, k_g  # all-empty rows -> 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _head_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T or S, H, K] -> [B, H, T or S, K] contiguous in the compute dtype: every chunk's rows and key span are
    then one strided block per (batch, head), which the batched GEMMs read without a copy."""
    return x.transpose(1, 2).to(dtype).contiguous()


def _dense_unselected(idx_c: torch.Tensor, lo: int, span: int) -> torch.Tensor:
    """idx_c [B, Tq, J] -> [B, 1, Tq, span] bool over keys [lo, lo + span), True where the key is NOT selected."""
    return _mqa_dense_mask(idx_c, lo, span).transpose(1, 2)


# The per-head form's masked-dense chunks (the absorbed form's idea, below): a chunk whose selected keys lie within
# PER_HEAD_DENSE_SPAN_RATIO * J positions runs [Tq, K] x [K, span] GEMMs per (batch, head) with unselected keys
# masked. The ratio is larger than the absorbed form's: a per-head gather moves H * J * (K + V) values per query
# (no head shares them), so at wide heads it is bound by memory traffic, and dense spans of many times J still win
# (measured in benchmarks/RESULTS.md). A GEMM over MIN_QUERY_CHUNK queries has too few rows to run near peak, so
# consecutive dense chunks are merged while the merged one still spans at most that many keys and its
# [B, H, Tq, span] scores hold at most DENSE_BUDGET elements; a gather chunk is never merged (its memory is the
# gather budget's). The merge reads only the spans already on the host: no further sync.
PER_HEAD_DENSE_SPAN_RATIO = 12
DENSE_BUDGET = 1 << 21  # elements of one merged [B, H, Tq, span] score chunk (8 MiB in fp32)


def _span_union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The smallest key range [lo, hi) holding both; (0, 0) is an all-empty chunk's (no keys)."""
    return b if a[1] == 0 else a if b[1] == 0 else (min(a[0], b[0]), max(a[1], b[1]))


def _per_head_chunks(topk_indices, num_keys, step, heads, static=False) -> list[tuple[int, int, int, int, bool]]:
    """(start, end, lo, hi, dense) per chunk of queries [start, end) with selected keys in [lo, hi)."""
    B, T, J = topk_indices.shape
    dense_budget = budget("dense", topk_indices.device, DENSE_BUDGET)
    plan: list[tuple[int, int, int, int, bool]] = []
    for start, span in zip(range(0, T, step), _chunk_spans(topk_indices, num_keys, step, static)):
        end, dense = min(start + step, T), span[1] - span[0] <= PER_HEAD_DENSE_SPAN_RATIO * J
        if dense and plan and plan[-1][4]:
            first = plan[-1][0]
            lo, hi = _span_union(plan[-1][2:4], span)
            if hi - lo <= PER_HEAD_DENSE_SPAN_RATIO * J and B * heads * (end - first) * (hi - lo) <= dense_budget:
                plan[-1] = (first, end, lo, hi, True)
                continue
        plan.append((start, end, *span, dense))
    return plan


def _sparse_forward(q, k, v, topk_indices, scale, static=False):
    """The per-head form's forward: [B, T, H, V] in q's dtype, contiguous."""
    dtype = _compute_dtype(q)
    q_h, k_h, v_h = (_head_major(x, dtype) for x in (q, k, v))  # [B, H, T or S, K or V]
    B, H, T, _ = q_h.shape
    S, J = k_h.shape[2], topk_indices.shape[-1]
    step = _query_chunk(B, H, J, max(q.shape[-1], v.shape[-1]), q.device)
    o = q_h.new_empty(B, T, H, v.shape[-1])
    for start, end, lo, hi, dense in _per_head_chunks(topk_indices, S, step, H, static):
        idx_c, span = topk_indices[:, start:end], hi - lo
        if dense:
            # masked-dense: [Tq, K] x [K, span] per (batch, head) over the chunk's key span, no gather
            scores = (q_h[:, :, start:end] @ k_h[:, :, lo:hi].transpose(-1, -2)).mul_(scale)  # [B, H, Tq, span]
            p = _mqa_dense_probs(scores, _dense_unselected(idx_c, lo, span))
            o[:, start:end] = (p @ v_h[:, :, lo:hi]).transpose(1, 2)
            continue
        p, safe, _ = _chunk_probs(q_h[:, :, start:end], k_h, idx_c, scale)
        o[:, start:end] = (p[..., None, :] @ _gather(v_h, safe)).squeeze(-2).transpose(1, 2)
    return o.to(q.dtype)


def _sparse_backward(q, k, v, topk_indices, do, scale, static=False):
    """-> (dq, dk, dv) in the inputs' dtypes, contiguous: recompute each chunk's probabilities; dense chunks add
    their key/value gradients over the span with GEMMs, gather chunks scatter them with index_add_."""
    dtype = _compute_dtype(q)
    q_h, k_h, v_h, do_h = (_head_major(x, dtype) for x in (q, k, v, do))
    B, H, T, D = q_h.shape
    S, E = k_h.shape[2], v_h.shape[-1]
    J = topk_indices.shape[-1]
    dq = q_h.new_empty(B, T, H, D)
    dk, dv = q_h.new_zeros(B, H, S, D), q_h.new_zeros(B, H, S, E)  # contiguous: rows of .view(B*H*S, *)
    rows = (torch.arange(B * H, device=q.device) * S).view(B, H, 1, 1)
    step = _query_chunk(B, H, J, max(D, E), q.device)
    for start, end, lo, hi, dense in _per_head_chunks(topk_indices, S, step, H, static):
        q_c, do_c, idx_c = q_h[:, :, start:end], do_h[:, :, start:end], topk_indices[:, start:end]
        if dense:
            dq[:, start:end] = _dense_chunk_backward(q_c, k_h, v_h, do_c, idx_c, lo, hi, scale, dk, dv)
            continue
        p, safe, k_g = _chunk_probs(q_c, k_h, idx_c, scale)
        dp = (_gather(v_h, safe) @ do_c[..., None]).squeeze(-1)  # [B, H, Tq, J]
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
        dq[:, start:end] = (ds[..., None, :] @ k_g).squeeze(-2).transpose(1, 2)
        flat = (rows + safe[:, None]).flatten()  # [B*H*Tq*J] row of dk.view(B*H*S, K)
        dk.view(-1, D).index_add_(0, flat, (ds[..., None] * q_c[..., None, :]).view(-1, D))
        dv.view(-1, E).index_add_(0, flat, (p[..., None] * do_c[..., None, :]).view(-1, E))
    dk, dv = (x.transpose(1, 2).to(y.dtype).contiguous() for x, y in ((dk, k), (dv, v)))
    return dq.to(q.dtype), dk, dv


def _dense_chunk_backward(q_c, k_h, v_h, do_c, idx_c, lo, hi, scale, dk, dv):
    """One masked-dense chunk: q_c, do_c [B, H, Tq, K or V] -> dq [B, Tq, H, K]; adds into dk, dv [B, H, S, *]
    over the keys [lo, hi) with plain GEMMs (the unselected keys have p = ds = 0, so they add nothing)."""
    k_s, v_s = k_h[:, :, lo:hi], v_h[:, :, lo:hi]  # [B, H, span, K or V]
    scores = (q_c @ k_s.transpose(-1, -2)).mul_(scale)  # [B, H, Tq, span]
    p = _mqa_dense_probs(scores, _dense_unselected(idx_c, lo, hi - lo))
    dp = do_c @ v_s.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    dk[:, :, lo:hi] += ds.transpose(-1, -2) @ q_c
    dv[:, :, lo:hi] += p.transpose(-1, -2) @ do_c
    return (ds @ k_s).transpose(1, 2)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather form: each query attends to its selected keys only, chunked over queries; same signature."""
    if cu_seqlens is not None:
        topk_indices = same_document_only(topk_indices, cu_seqlens, k.shape[1])
    return _sparse_op(q, k, v, topk_indices, scale)


register("sparse_attention", "reference", sparse_attention_reference)
register("sparse_attention", "fast", sparse_attention)


# ------------------------------------------------------------------------------ absorbed MLA: one shared latent
# MLA's keys and values are per-head linear maps of one latent c_s [Z] (kv_lora_rank). Absorbing the maps into
# the query (q_abs = W_uk^T q) and the output (o = W_uv o_lat) leaves multi-query attention in the latent with
# key = value = c: one gathered [Tq, J, Z] tensor serves every head, instead of per-head keys AND values.
# Legend as above with Z the latent width (the code's C); q: [B, T, H, Z], kv: [B, S, Z]; returns [B, T, H, Z].
def sparse_mqa_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense scores against the shared latent, masked to the selected set (O(T * S))."""
    if cu_seqlens is not None:
        return _per_document(sparse_mqa_attention_reference, q, (kv,), topk_indices, scale, cu_seqlens)
    mask = topk_to_mask(topk_indices, kv.shape[1])  # [B, T, S]
    scores = torch.einsum("bthc,bsc->bhts", q.float(), kv.float()) * scale
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bsc->bthc", probs, kv.float()).to(q.dtype)


def _mqa_gather(kv, idx_c):
    """kv [B, S, Z], idx_c [B, Tq, J] -> (valid [B, Tq, J], safe idx, gathered rows [B, Tq, J, Z])."""
    S = kv.shape[1]
    valid = (idx_c >= 0) & (idx_c < S)
    safe = idx_c.long().clamp(0, S - 1)
    rows = (torch.arange(kv.shape[0], device=kv.device) * S)[:, None, None]
    # index_select on the flattened rows: a plain row copy, cheaper on CPU than the advanced-indexing kv[b, safe]
    kv_g = kv.reshape(-1, kv.shape[-1]).index_select(0, (rows + safe).flatten()).view(*safe.shape, -1)
    return valid, safe, kv_g


def _mqa_softmax(scores, valid):
    """scores [B, Tq, H, J] (already scaled), valid [B, Tq, J] -> probs; all-empty rows -> 0."""
    return torch.softmax(scores.masked_fill(~valid[:, :, None], float("-inf")), dim=-1).nan_to_num(0.0)


# Masked-dense chunks: when a chunk's selected keys are a large fraction of the keys it can reach (its key span,
# from the smallest to the largest selected position, e.g. the causal prefix of its document), the per-query
# gather of J latent rows and the [H, Z] x [Z, J] per-query matmuls cost more than plain [Tq*H, Z] x [Z, span]
# GEMMs over the whole span with the unselected keys masked to -inf: the same sum over the same keys, no gather
# and no scatter-add of the key gradients. A chunk goes dense when span <= DENSE_SPAN_RATIO * J, which keeps the
# dense work O(T * J); the ratio is the fastest one measured (benchmarks/RESULTS.md). In a causal sequence this
# sends the early chunks dense (and, packed, the early chunks of every document).
DENSE_SPAN_RATIO = 4


def _mqa_chunk_spans(topk_indices: torch.Tensor, num_keys: int, step: int) -> list[tuple[int, int]]:
    """Keys [lo, hi) holding every selected position of each chunk of `step` queries ((0, 0) for an all-empty
    chunk), all chunks in one reduction and one host transfer before the loop. lo > 0 is what keeps a late packed
    document's chunks on the dense path: its keys start at the document, not at 0."""
    B, T, J = topk_indices.shape
    n = -(-T // step)
    if not topk_indices.numel():
        return [(0, 0)] * n
    idx = F.pad(topk_indices, (0, 0, 0, n * step - T), value=-1).view(B, n, step * J).transpose(0, 1)
    valid = (idx >= 0) & (idx < num_keys)  # [n, B, step*J]
    lo = torch.where(valid, idx, num_keys).flatten(1).amin(-1)
    hi = torch.where(valid, idx, -1).flatten(1).amax(-1) + 1
    spans = torch.stack([lo, hi], dim=-1).tolist()  # NOTE: syncs (once per call, not per chunk)
    return [(a, b) if b > 0 else (0, 0) for a, b in spans]


def _chunk_spans(topk_indices: torch.Tensor, num_keys: int, step: int, static: bool) -> list[tuple[int, int]]:
    """Each chunk's key range: the selected one (`_mqa_chunk_spans`, one host read), or with `static` every key
    [0, S) for every chunk, from the shapes alone (the "static" backends: no host read)."""
    if static:
        return [(0, num_keys)] * -(-topk_indices.shape[1] // step)
    return _mqa_chunk_spans(topk_indices, num_keys, step)


def _mqa_dense_mask(idx_c, lo, span):
    """idx_c [B, Tq, J] -> [B, Tq, 1, span] bool over keys [lo, lo + span), True where the key is NOT selected."""
    idx_c = idx_c - lo
    valid = (idx_c >= 0) & (idx_c < span)
    selected = torch.zeros(*idx_c.shape[:2], span + 1, dtype=torch.bool, device=idx_c.device)
    selected.scatter_(-1, torch.where(valid, idx_c.long(), span), True)  # empty slots land in column `span`
    return ~selected[:, :, None, :span]


def _mqa_dense_probs(scores, masked_out):
    """scores [B, Tq, H, span] (already scaled) -> probs with unselected keys 0; all-empty rows -> 0."""
    return torch.softmax(scores.masked_fill_(masked_out, float("-inf")), dim=-1).nan_to_num_(0.0)


def _rows(x):
    """[B, Tq, H, Z] -> [B, Tq*H, Z]: every (query, head) row of a chunk in one GEMM against the shared latent."""
    return x.flatten(1, 2)


def _mqa_forward(q, kv, topk_indices, scale, static=False):
    """The absorbed gather form's forward: [B, T, H, Z] in q's dtype, contiguous."""
    dtype = _compute_dtype(q)
    q32, kv32 = q.to(dtype).contiguous(), kv.to(dtype).contiguous()
    B, T, H, C = q.shape
    S, J = kv.shape[1], topk_indices.shape[-1]
    step = _query_chunk(B, 1, J, C + H, q.device)
    o = q32.new_empty(B, T, H, C)
    for start, (lo, hi) in zip(range(0, T, step), _chunk_spans(topk_indices, S, step, static)):
        end = min(start + step, T)
        idx_c, span = topk_indices[:, start:end], hi - lo
        if span <= DENSE_SPAN_RATIO * J:
            kv_s = kv32[:, lo:hi]
            q_c = q32[:, start:end]
            scores = (_rows(q_c) @ kv_s.transpose(-1, -2)).mul_(scale).view(*q_c.shape[:-1], span)
            p = _mqa_dense_probs(scores, _mqa_dense_mask(idx_c, lo, span))  # [B, Tq, H, span]
            o[:, start:end] = (_rows(p) @ kv_s).view(q_c.shape)
        else:
            valid, _, kv_g = _mqa_gather(kv32, idx_c)
            p = _mqa_softmax((q32[:, start:end] @ kv_g.transpose(-1, -2)) * scale, valid)  # [B, Tq, H, J]
            o[:, start:end] = p @ kv_g
    return o.to(q.dtype)


def _mqa_backward(q, kv, topk_indices, do, scale, static=False):
    """-> (dq, dkv) in the inputs' dtypes, contiguous: recompute each chunk's probabilities, scatter dkv."""
    dtype = _compute_dtype(q)
    # contiguous: a strided q or do (an einsum's output, an expanded sum's gradient) makes every chunk's bmm
    # fall back to one copy per query
    q32, kv32, do32 = (x.to(dtype).contiguous() for x in (q, kv, do))
    B, T, H, C = q.shape
    S, J = kv.shape[1], topk_indices.shape[-1]
    dq, dkv = q32.new_empty(B, T, H, C), q32.new_zeros(B * S, C)
    rows = (torch.arange(B, device=q.device) * S)[:, None, None]
    step = _query_chunk(B, 1, J, C + H, q.device)
    for start, (lo, hi) in zip(range(0, T, step), _chunk_spans(topk_indices, S, step, static)):
        end = min(start + step, T)
        q_c, do_c, idx_c = q32[:, start:end], do32[:, start:end], topk_indices[:, start:end]
        span = hi - lo
        if span <= DENSE_SPAN_RATIO * J:
            kv_s = kv32[:, lo:hi]
            # scores (q kv^T) and dp (do kv^T) in one GEMM over the stacked (query, head) rows
            q_do = torch.cat([_rows(q_c), _rows(do_c)], dim=1)  # [B, 2*Tq*H, Z]
            scores, dp = (q_do @ kv_s.transpose(-1, -2)).view(B, 2, *q_c.shape[1:3], span).unbind(1)
            p = _mqa_dense_probs(scores.mul_(scale), _mqa_dense_mask(idx_c, lo, span))  # [B, Tq, H, span]
            ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
            dq[:, start:end] = (_rows(ds) @ kv_s).view(q_c.shape)
            # as key (ds^T q) plus as value (p^T do), one GEMM over the stacked (query, head) rows: [B, span, Z]
            pd = torch.cat([_rows(ds), _rows(p)], dim=1)  # [B, 2*Tq*H, span]
            dkv.view(B, S, C)[:, lo:hi] += pd.transpose(-1, -2) @ q_do
            continue
        valid, safe, kv_g = _mqa_gather(kv32, idx_c)
        # scores (q kv^T) and dp (do kv^T) in one matmul over the stacked head axis: [B, Tq, 2H, J]
        q_do = torch.cat([q_c, do_c], dim=-2)
        scores, dp = (q_do @ kv_g.transpose(-1, -2)).split(H, dim=-2)
        p = _mqa_softmax(scores * scale, valid)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
        dq[:, start:end] = ds @ kv_g
        # as key (ds^T q) plus as value (p^T do), in one matmul over the stacked head axis: [B, Tq, J, Z]
        dkv_g = torch.cat([ds, p], dim=-2).transpose(-1, -2) @ q_do
        dkv.index_add_(0, (rows + safe).flatten(), dkv_g.reshape(-1, C))
    return dq.to(q.dtype), dkv.view(B, S, C).to(kv.dtype)


def sparse_mqa_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather form of the absorbed attention, chunked over queries, hand-written backward; same signature."""
    if cu_seqlens is not None:
        topk_indices = same_document_only(topk_indices, cu_seqlens, kv.shape[1])
    return _mqa_op(q, kv, topk_indices, scale)


register("sparse_mqa_attention", "reference", sparse_mqa_attention_reference)
register("sparse_mqa_attention", "fast", sparse_mqa_attention)


# ---------------------------------------------------------------------------------------- torch.compile boundary
# Both fast forms run as custom ops (kernels/opaque.py): torch.compile sees one opaque call with a fake
# implementation for the shapes, instead of a Python loop over chunks and the absorbed form's span sync; the
# hand-written backward is the op's autograd formula, itself a custom op. Outputs are contiguous, as the fakes say.
# `per_head_op` / `absorbed_op` make the pair (forward op, backward op) of one form under `name`; `static` plans the
# chunks from shapes alone (kernels/sparse_static.py), `tags` are the forward and backward ops' tags.
def per_head_op(name: str, static: bool, tags: tuple):
    @torch.library.custom_op(f"glm53::{name}", mutates_args=(), tags=tags)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_indices: torch.Tensor, scale: float) -> torch.Tensor:
        return _sparse_forward(q, k, v, topk_indices, scale, static)

    @op.register_fake
    def _(q, k, v, topk_indices, scale):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @torch.library.custom_op(f"glm53::{name}_backward", mutates_args=(), tags=tags)
    def backward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_indices: torch.Tensor, do: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _sparse_backward(q, k, v, topk_indices, do, scale, static)

    @backward_op.register_fake
    def _(q, k, v, topk_indices, do, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output) -> None:
        q, k, v, topk_indices, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, topk_indices)

    def grad(ctx, do):
        return (*backward_op(*ctx.saved_tensors, do, ctx.scale), None, None)

    op.register_autograd(grad, setup_context=setup)
    return op


def absorbed_op(name: str, static: bool, tags: tuple):
    @torch.library.custom_op(f"glm53::{name}", mutates_args=(), tags=tags)
    def op(q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor, scale: float) -> torch.Tensor:
        return _mqa_forward(q, kv, topk_indices, scale, static)

    @op.register_fake
    def _(q, kv, topk_indices, scale):
        return q.new_empty(q.shape)

    @torch.library.custom_op(f"glm53::{name}_backward", mutates_args=(), tags=tags)
    def backward_op(
        q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor, do: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _mqa_backward(q, kv, topk_indices, do, scale, static)

    @backward_op.register_fake
    def _(q, kv, topk_indices, do, scale):
        return q.new_empty(q.shape), kv.new_empty(kv.shape)

    def setup(ctx, inputs, output) -> None:
        q, kv, topk_indices, ctx.scale = inputs
        ctx.save_for_backward(q, kv, topk_indices)

    def grad(ctx, do):
        return (*backward_op(*ctx.saved_tensors, do, ctx.scale), None, None)

    op.register_autograd(grad, setup_context=setup)
    return op


_sparse_op = per_head_op("sparse_attention", False, HOST_READING)
_mqa_op = absorbed_op("sparse_mqa_attention", False, HOST_READING)
