"""Packed documents: several documents in one row, each computed exactly as if it ran alone.

Legend: B batch, T time, P pools, L tokens per pool (index_kpool), n documents.
Two ways in (Glm53ForCausalLM.forward / Glm53Model.forward):
- `cu_seqlens` int [n + 1]: cumulative document lengths over the flattened [B, T] tokens (fla's convention; the
  usual form is input_ids [1, total]). With B > 1, every row start is added as a boundary.
- `position_ids` [B, T]: restarting at 0 at each document (transformers' DataCollatorWithFlattening); a document
  starts wherever the position does not continue the previous one (at every 0 in that convention) and at every
  row start, the rule the loss counts use too (glm53/losses/counts.py, `document_spans`).
Both become one `cu_seqlens` over the flattened tokens, with every row start in it (kernels/varlen.py), and
`segment_ids` [B, T], the document index of every token; ForwardContext carries both. A batch whose rows each
hold one document needs neither: `document_boundaries` returns None and the ordinary path runs. Under
torch.compile the boundaries keep their duplicates (empty documents: a count from the shapes, no graph break)
and the packed path always runs; every consumer skips empty documents. From `position_ids` the compiled
boundaries are the starts then B * T repeated, B * T + 1 entries whatever the document count (`static_boundaries`):
one graph serves every batch of that shape.
Padding (`attention_mask`) combines with packing: padded tokens stay invalid inside their document, and a
document's k-pools start at its first valid token.
"""

from __future__ import annotations

import torch

from ..kernels.varlen import check_cu_seqlens, document_bounds, token_documents
from ..utils import ceil_div


def document_boundaries(
    B: int,
    T: int,
    device: torch.device,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """-> int64 cu_seqlens over the flattened B * T tokens (row starts included, empty documents dropped), or
    None when there is nothing packed (no boundaries given, or one document per row). Under torch.compile, never
    None: with `cu_seqlens` the boundaries and row starts sorted, duplicates kept; with `position_ids`
    `static_boundaries` (module docstring). position_ids' values need no check: any integers give valid starts."""
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("pass at most one of cu_seqlens and position_ids (both describe document boundaries)")
    if position_ids is not None:
        if tuple(position_ids.shape) != (B, T) or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"position_ids must be an integer tensor of shape {(B, T)} (restarting at 0 at each "
                f"document), got {position_ids.dtype} {tuple(position_ids.shape)}"
            )
        cu = starts_to_cu_seqlens(position_starts(position_ids.to(device)))
        if torch.compiler.is_compiling():
            return cu
        return None if cu.numel() - 1 == B else cu  # NOTE: syncs
    if cu_seqlens is None:
        return None
    # the boundaries as given: 1-D integer, from 0 to B * T, non-decreasing (named errors from the check)
    row_starts = torch.arange(0, B * T + 1, T, device=device)
    cu = torch.cat([check_cu_seqlens(cu_seqlens.to(device), 1, B * T), row_starts])
    if torch.compiler.is_compiling():
        # torch.unique's size and the one-document-per-row test read the data (graph breaks): sorted with the
        # duplicates kept as empty documents, [n + 1 + B + 1] from the shapes; every consumer skips empty documents
        return torch.sort(cu).values
    cu = torch.unique(cu)  # sorted; duplicates (empty documents, row starts given twice) removed
    return None if cu.numel() - 1 == B else cu  # NOTE: syncs


def position_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool document starts from position_ids [B, T]: where the position does not continue the previous one
    (at every 0 in transformers' padding-free convention) and at every row start."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def starts_to_cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """Document starts [B, T] bool -> int64 cu_seqlens [n + 1] over the flattened B * T tokens; every row start
    counts as a start, set or not. The one rule from starts to boundaries (packing, context parallelism, the keys'
    sequence). Under torch.compile the `static_boundaries` form, [B * T + 1] from the shape."""
    B, T = starts.shape
    starts = starts.clone()
    starts[:, 0] = True
    if torch.compiler.is_compiling():  # no data-dependent size: empty documents last
        return static_boundaries(starts)
    flat = torch.nonzero(starts.flatten()).flatten()  # NOTE: syncs
    return torch.cat([flat, flat.new_full((1,), B * T)])


def static_boundaries(starts: torch.Tensor) -> torch.Tensor:
    """Document starts [B, T] bool (every row start set) -> int64 cu_seqlens [B * T + 1], a size from the shape:
    the start positions in order, then B * T for every token that starts nothing (empty documents at the end).
    torch.nonzero's size is the document count, which a compiled graph cannot hold without a break per count."""
    total = starts.numel()
    flat = torch.where(starts.flatten(), torch.arange(total, device=starts.device), total)
    return torch.cat([torch.sort(flat).values, flat.new_full((1,), total)])


def segment_ids(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, T] int64 document index of every token, counting only non-empty documents (0, 1, ... along the
    flattened tokens; without empty documents it is `token_documents`), so every id is below B * T and below
    the document count n."""
    starts = torch.zeros(B * T + 1, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[:-1]] = 1  # an empty document starts where the next one does: one mark for both
    return (starts[:-1].cumsum(0) - 1).view(B, T)


def document_labels(labels: torch.Tensor, segment_ids: torch.Tensor, depth: int, ignore_index: int) -> torch.Tensor:
    """Labels aligned like input_ids for `causal_lm_loss` at MTP depth `depth` (0: the next-token loss).

    Position i predicts token i + 1 + depth, so the aligned label at i + 1 is labels[i + 1 + depth]; it is
    ignored when that token lies in another document than position i (a document's last token has no next
    token; MTP never predicts across a boundary).
    """
    T = labels.shape[1]
    d = min(depth, T)
    fill = lambda x, v: torch.cat([x[:, d:], x.new_full((x.shape[0], d), v)], dim=1)  # noqa: E731
    ahead = fill(segment_ids, -1)  # document of token j + depth
    previous = torch.cat([segment_ids[:, :1], segment_ids[:, :-1]], dim=1)  # document of the predicting position
    return fill(labels, ignore_index).masked_fill(ahead != previous, ignore_index)


def first_valid_in_document(valid: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B, T] row-local position of the first valid token of each token's document (its end if it has none)."""
    B, T = valid.shape
    start, end = document_bounds(cu_seqlens, B, T)
    pos = torch.arange(T, device=valid.device).expand(B, T)
    # next valid position at or after every position, via a reverse running minimum
    next_valid = torch.where(valid, pos, T).flip(-1).cummin(-1).values.flip(-1)
    return torch.minimum(next_valid.gather(1, start.clamp(max=T - 1)), end)


def document_pool_layout(
    valid: torch.Tensor, cu_seqlens: torch.Tensor, kpool: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools of `kpool` consecutive positions from each document's first valid token, never past its end.

    -> positions [B, P, L] (row-local; an empty slot holds T.., past every token) and which of them are valid
    tokens of the pool's document [B, P, L]. A row's pools are its documents' pools in order, so each document
    owns a contiguous run of slots. P = ceil(T / L) + n - B + 1 bounds every row's pool count (a row's m documents
    of lengths l_i have at most sum(floor(l_i / L) + 1) <= T / L + m pools, and m <= n - B + 1). The slots past a
    row's pools are empty. Loop-free over documents.
    Under torch.compile only whole pools of L positions are laid out, P = max(T // L, 1) (they are disjoint runs of
    a row's T positions): a size from the shapes that does not grow with n, which from position_ids is B * T
    (`static_boundaries`). A document's short last pool is never complete, so never a candidate, and the indexer
    KL masks its attention mass out: dropping it changes no output, only the width of the [B, T, P] scores.
    """
    B, T = valid.shape
    flat_valid = valid.flatten()
    n = cu_seqlens.numel() - 1
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    doc = token_documents(cu_seqlens, B * T)
    pos = torch.arange(B * T, device=valid.device)
    first = torch.full((n,), B * T, device=valid.device, dtype=torch.long)
    first = torch.minimum(first.scatter_reduce(0, doc, torch.where(flat_valid, pos, B * T), "amin"), ends)
    whole_only = torch.compiler.is_compiling()
    counts = (ends - first) // kpool if whole_only else ceil_div(ends - first, kpool)  # pools per document
    past = counts.cumsum(0)  # pools of this and all earlier documents
    before = past - counts
    row = (starts // T).clamp(max=B - 1)
    rows = torch.arange(B, device=valid.device)
    row_first_doc = torch.searchsorted(starts, rows * T)
    P = max(T // kpool, 1) if whole_only else ceil_div(T, kpool) + n - B + 1
    pool = before[row_first_doc, None] + torch.arange(P, device=valid.device)  # [B, P] global pool numbers
    pool_doc = torch.searchsorted(past, pool, right=True).clamp(max=n - 1)  # [B, P] the document owning each
    j = pool - before[pool_doc]  # the pool's number inside its document
    used = (row[pool_doc] == rows[:, None]) & (j < counts[pool_doc])  # [B, P] slots holding one of the row's pools
    slots = torch.arange(kpool, device=valid.device)
    tokens = first[pool_doc, None] + j[..., None] * kpool + slots  # [B, P, L] flattened positions
    token_valid = used[..., None] & (tokens < ends[pool_doc, None]) & flat_valid[tokens.clamp(0, B * T - 1)]
    positions = torch.where(used[..., None], tokens - rows[:, None, None] * T, T + slots)
    return positions, token_valid


__all__ = [
    "document_boundaries",
    "document_labels",
    "document_pool_layout",
    "first_valid_in_document",
    "position_starts",
    "segment_ids",
    "starts_to_cu_seqlens",
    "static_boundaries",
]
