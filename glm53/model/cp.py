"""Context parallelism inside the model: what the blocks compute from this rank's slice of every sequence.

Legend (glm53/model/__init__.py): B batch, T time (this rank's slice), W causal-conv kernel width; d is an MTP
depth (a shift in positions).
Every rank holds positions [cp.offset, cp.offset + T) of each row (glm53.parallel.context_parallel_inputs) and
reaches the other slices only through `ForwardContext.cp` (a SequenceShards): the model never imports
torch.distributed. The helpers here:
- `sharded_packing_fields`: packed documents from this slice's `position_ids` (restarting at 0 per document):
  local boundaries for the kernels (`cu_seqlens`, row starts included) and the document index of every token
  as one process numbers it (`segment_ids`, the same numbers on every rank, so slices can be compared).
- `halo_starts`: document starts over the previous rank's last W - 1 positions and this slice (convs, KDA).
- `ahead`: x shifted left by d positions, the last d taken from the next rank (MTP, its labels).
- `sharded_targets`: this slice's targets at each MTP depth from next-token targets (documents respected).
- `across_ranks`: a loss part whose value is the sum over the ranks and whose gradient is cp x this rank's.
Every rank calls the same collectives in the same order, whatever its own slice holds.
"""

from __future__ import annotations

import torch

from .context import SequenceShards
from .packing import position_starts, starts_to_cu_seqlens


def sharded_packing_fields(position_ids: torch.Tensor, cp: SequenceShards) -> dict[str, torch.Tensor]:
    """ForwardContext's `cu_seqlens` (local) and `segment_ids` (global numbering) for this slice.

    A document starts where the position does not continue the previous one (model/packing.py's rule), the
    previous position of a slice's first token being the previous rank's last one; row starts always start one.
    """
    B, T = position_ids.shape
    pos = position_ids.long()
    before = cp.from_previous(pos, 1)[:, 0]  # [B] the previous rank's last position (zeros on rank 0)
    starts = position_starts(pos)
    starts[:, 0] = (pos[:, 0] != before + 1) | (cp.rank == 0)
    counts = cp.stack(starts.sum(-1))  # [size, B] documents starting in each rank's slice of each row
    per_row = counts.sum(0)
    first = per_row.cumsum(0) - per_row + counts[: cp.rank].sum(0)  # [B] documents before this slice
    segments = first[:, None] + starts.long().cumsum(-1) - 1
    return dict(cu_seqlens=starts_to_cu_seqlens(starts), segment_ids=segments)


def halo_starts(segment_ids: torch.Tensor, cp: SequenceShards, width: int) -> torch.Tensor:
    """[B, width + T] bool: document starts over the previous rank's last `width` positions and this slice.

    Position 0 (the first halo position, or the slice's first token on rank 0) always counts as a start.
    """
    halo = cp.from_previous(segment_ids, max(width, 1))  # [B, max(width, 1)]
    if cp.rank == 0:
        halo = torch.full_like(halo, -1)  # no tokens before the sequence
    ext = torch.cat([halo, segment_ids], dim=1)
    starts = torch.ones_like(ext, dtype=torch.bool)
    starts[:, 1:] = ext[:, 1:] != ext[:, :-1]
    return starts[:, max(width, 1) - width :]


def ahead(x: torch.Tensor, d: int, fill: float | bool | int, cp: SequenceShards | None = None) -> torch.Tensor:
    """x [B, T, ...] -> the values d positions ahead, `fill` past the end of the sequence (d <= T under cp)."""
    if x.dtype == torch.bool:  # exchanged as integers
        return ahead(x.long(), d, int(fill), cp).bool()
    if d == 0:
        return x
    if cp is None:
        tail = x[:, :0].new_full((x.shape[0], min(d, x.shape[1]), *x.shape[2:]), fill)
        return torch.cat([x[:, d:], tail], dim=1)
    if d > x.shape[1]:
        raise ValueError(f"MTP depth {d} exceeds this rank's {x.shape[1]} positions: use fewer context-parallel ranks")
    nxt = cp.from_next(x, d)
    if cp.rank == cp.size - 1:
        nxt = torch.full_like(nxt, fill) + 0 * nxt if nxt.is_floating_point() else torch.full_like(nxt, fill)
    return torch.cat([x[:, d:], nxt], dim=1)


def sharded_targets(
    targets: torch.Tensor, segment_ids: torch.Tensor | None, d: int, cp: SequenceShards, ignore_index: int
) -> torch.Tensor:
    """The targets of this slice's positions at MTP depth d (0: next token) from next-token targets [B, T]
    (labels shifted by one over the whole sequence): targets[i + d], ignored past the end and when token
    i + 1 + d lies in another document than position i (model/packing.py's `document_labels`)."""
    out = ahead(targets, d, ignore_index, cp)
    if segment_ids is None:
        return out
    return out.masked_fill(ahead(segment_ids, d + 1, -1, cp) != segment_ids, ignore_index)


def across_ranks(value: torch.Tensor | None, cp: SequenceShards) -> torch.Tensor | None:
    """A loss part from this rank's share `value` (its sum over the ranks is the whole loss): the value is that
    sum, the gradient cp.size x this rank's share, so that FSDP's average over the ranks (dp x cp) gives one
    process's gradient; the collectives' backward carries the rest of every share to the ranks it came from."""
    if value is None:
        return None
    scaled = value * cp.size
    return scaled + (cp.sum(value) - scaled).detach()


__all__ = ["across_ranks", "ahead", "halo_starts", "sharded_packing_fields", "sharded_targets"]
