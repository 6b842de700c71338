"""Packed-document boundaries as the kernels take them (fla's `cu_seqlens` convention, over B * T tokens).

Legend: B batch, T time, n documents, P indexer k-pools.
cu_seqlens: int [n + 1], cumulative document lengths over the row-major flattened [B, T] tokens: starts at 0,
ends at B * T, non-decreasing, and holds every row start (b * T): a document never spans two rows. Every kernel
that takes it treats each document as if it were alone (no state, tap, key or pool crosses a boundary).
The helpers here turn it into per-token forms; each is O(B * T) and loop-free.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Boundaries already validated, with the (B, T) and tensor version they were checked for: the model makes one
# cu_seqlens per forward and hands the same tensor to every layer's kernels, so its values are read once (three
# host syncs) where it is first checked, not again in each kernel call (an in-place change bumps the version).
_VALIDATED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Validate `cu_seqlens` for a [B, T] batch and return it as int64 (raises ValueError naming the problem)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.long()
    if torch.compiler.is_compiling():  # the value checks read the data on the host (a graph break each); the model
        return cu  # made these boundaries itself (model/packing.py document_boundaries), eagerly
    if cu.is_inference():  # inference tensors keep no version counter: checked every call (no in-place edits seen)
        _check_values(cu, B, T)
        return cu
    if _VALIDATED.get(cu) == (B, T, cu._version):
        return cu
    _check_values(cu, B, T)
    _VALIDATED[cu] = (B, T, cu._version)
    return cu


def _check_values(cu: torch.Tensor, B: int, T: int) -> None:
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != B * T:  # NOTE: syncs
        raise ValueError(f"cu_seqlens must start at 0 and end at {B * T} (batch {B} x seq {T}), got {cu.tolist()}")
    if bool((cu.diff() < 0).any()):  # NOTE: syncs
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    if B > 1 and not bool(torch.isin(torch.arange(0, B * T, T, device=cu.device), cu).all()):
        raise ValueError(f"cu_seqlens must hold every row start (multiples of {T}): documents cannot span rows")


def token_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] index of each flattened token's document (empty documents own no token)."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True)


def document_bounds(cu_seqlens: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-local [start, end) of each token's document: two [B, T] int64 tensors."""
    doc = token_documents(cu_seqlens, B * T)
    row_start = (torch.arange(B * T, device=doc.device) // T) * T
    start = (cu_seqlens[doc] - row_start).view(B, T)
    end = (cu_seqlens[doc + 1] - row_start).view(B, T)
    return start, end


def position_in_document(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] tokens since the start of each token's document (0 at a document's first token)."""
    doc = token_documents(cu_seqlens, total)
    return torch.arange(total, device=doc.device) - cu_seqlens[doc]


def document_slices(cu_seqlens: torch.Tensor, T: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every non-empty document, row-local: for the references, which loop over them."""
    bounds = cu_seqlens.tolist()  # NOTE: syncs
    return [(s // T, s % T, s % T + (e - s)) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def own_document_pools(
    pool_start: torch.Tensor, cu_seqlens: torch.Tensor, S: int, query_offset: int, T: int
) -> torch.Tensor:
    """[B, T, P] bool: the pool starts inside the document of query query_offset + t (pool_start [B, P] and the
    boundaries `cu_seqlens` over B * S describe the keys' sequence): the packed `indexer_scores` column mask."""
    start, end = document_bounds(cu_seqlens, pool_start.shape[0], S)
    rows = slice(query_offset, query_offset + T)
    columns = pool_start[:, None, :]
    return (columns >= start[:, rows, None]) & (columns < end[:, rows, None])


__all__ = [
    "check_cu_seqlens",
    "document_bounds",
    "document_slices",
    "own_document_pools",
    "position_in_document",
    "token_documents",
]
