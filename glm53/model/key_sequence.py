"""The keys' sequence an attention layer's queries read: the whole sequence, also under context parallelism.

Legend (glm53/model/__init__.py): B batch, T time (this rank's queries), S keys (the whole sequence), J selected
key slots per query.
On one process the queries are the keys' own positions (S == T, offset 0). Under context parallelism
(ForwardContext.cp) a rank holds positions [offset, offset + T) of every sequence; MLA gathers its keys (the kv
latent, the indexer's per-token keys) from every rank, so it needs the padding mask and the document boundaries
of the whole sequence too. They are gathered here from the ranks' slices:
- `valid`: every rank's ctx.valid.
- documents: under cp, ctx.segment_ids [B, T] must hold *global* document ids (the same id on both sides of a
  rank boundary a document crosses, a different one where a new document starts there) and be set on every rank
  whenever any document boundary lies inside a row (whoever builds the context under cp guarantees this; a
  rank's local ctx.cu_seqlens cannot say whether its first token continues the previous rank's document). The
  gathered ids give boundaries over the whole sequence, the same `cu_seqlens` one process builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.varlen import document_bounds
from .context import ForwardContext
from .packing import starts_to_cu_seqlens


@dataclass
class KeySequence:
    """The sequence the keys come from, and where this rank's queries sit in it."""

    valid: torch.Tensor  # [B, S] bool
    cu_seqlens: torch.Tensor | None  # [n_docs + 1] int64 over the flattened B * S tokens (None: one doc per row)
    offset: int  # position of the first query in the keys' sequence


def key_sequence(ctx: ForwardContext) -> KeySequence:
    """The keys' sequence of a forward: ctx's own (one process) or every cp rank's slices gathered."""
    if ctx.cp is None:
        return KeySequence(ctx.valid, ctx.cu_seqlens, 0)
    # gloo gathers no bool: the mask travels as uint8
    valid = ctx.cp.all_gather(ctx.valid.to(torch.uint8), dim=1).bool()
    cu_seqlens = None
    if ctx.segment_ids is not None:
        cu_seqlens = segment_boundaries(ctx.cp.all_gather(ctx.segment_ids, dim=1))
    return KeySequence(valid, cu_seqlens, ctx.cp.offset)


def segment_boundaries(segment_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, S] document ids -> cu_seqlens over the flattened tokens (a boundary wherever the id changes and at
    every row start), or None when every row is one document (as `document_boundaries` returns)."""
    breaks = torch.ones_like(segment_ids, dtype=torch.bool)
    breaks[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    cu = starts_to_cu_seqlens(breaks)
    if torch.compiler.is_compiling():  # B * S + 1 entries, empty documents last (never None): no data-dependent size
        return cu
    return None if cu.numel() - 1 == segment_ids.shape[0] else cu


def same_document_slots(topk: torch.Tensor, keys: KeySequence) -> torch.Tensor:
    """topk [B, T, J] key positions with every slot outside its query's document set to -1 (what the packed
    attention kernels do when queries and keys coincide; here the queries are a slice of the keys' sequence)."""
    if keys.cu_seqlens is None:
        return topk
    B, S = keys.valid.shape
    rows = slice(keys.offset, keys.offset + topk.shape[1])
    start, end = (bound[:, rows, None] for bound in document_bounds(keys.cu_seqlens, B, S))
    return topk.masked_fill((topk < start) | (topk >= end), -1)


__all__ = ["KeySequence", "key_sequence", "same_document_slots", "segment_boundaries"]
