"""Which part of a (possibly sharded) tensor this rank holds, as boxes of global indices.

Legend: a box is one (local start, global start, length) run per dimension; the product of one run per dimension
is a rectangular block that sits contiguously (up to strides) both in the local shard and in the full tensor.
A `Shard` placement gives one run per dimension, a `_StridedShard` (FSDP over a TP-sharded dimension, or the packed
gate/up experts under TP) may give several: the rank's rows of the full tensor are then not one range.

The checkpoint loader reads each box from disk, the exporter sends each box to the key's writer, and the DCP
training state (train_state.py) stores each box as one chunk, so any placement saves and reshards exactly.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

Run = tuple[int, int, int]  # (local start, global start, length)


def _shards_dim(placement, dim: int) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim


def _as_dim0(placement):
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


def global_indices(tensor: torch.Tensor, dim: int) -> list[int]:
    """The full tensor's indices along `dim` that this rank's local shard holds, in local order.

    Computed the way DTensor slices: an index vector distributed with the tensor's placements on `dim` (no
    communication), so every placement DTensor supports (uneven, strided) is covered.
    """
    size = tensor.shape[dim]
    if not isinstance(tensor, DTensor):
        return list(range(size))
    placements = [_as_dim0(p) if _shards_dim(p, dim) else Replicate() for p in tensor.placements]
    if all(isinstance(p, Replicate) for p in placements):
        return list(range(size))
    index = torch.arange(size, device=tensor.device_mesh.device_type)
    return distribute_tensor(index, tensor.device_mesh, placements, src_data_rank=None).to_local().tolist()


def runs(indices: list[int]) -> list[Run]:
    """Consecutive global indices grouped: [3, 4, 5, 9, 10] -> [(0, 3, 3), (3, 9, 2)]."""
    out: list[Run] = []
    for local, g in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == g:
            start_local, start, length = out[-1]
            out[-1] = (start_local, start, length + 1)
        else:
            out.append((local, g, 1))
    return out


def local_boxes(tensor: torch.Tensor) -> list[tuple[Run, ...]]:
    """This rank's part of `tensor` as boxes (one run per dimension); [] when it holds nothing."""
    per_dim = [runs(global_indices(tensor, d)) for d in range(tensor.dim())]
    return [tuple(box) for box in itertools.product(*per_dim)]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def box_slices(box: tuple[Run, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(local slices, global slices) of one box."""
    local = tuple(slice(lo, lo + n) for lo, _, n in box)
    glob = tuple(slice(g, g + n) for _, g, n in box)
    return local, glob


def intersect(box: tuple[Run, ...], region: tuple[slice, ...]) -> tuple[Run, ...] | None:
    """The part of `box` inside the global `region` (one slice per dimension), or None when they do not meet."""
    out = []
    for (lo, g, n), r in zip(box, region):
        start, stop = max(g, r.start), min(g + n, r.stop)
        if start >= stop:
            return None
        out.append((lo + start - g, start, stop - start))
    return tuple(out)


def is_primary(tensor: torch.Tensor) -> bool:
    """True on exactly one of the ranks holding each element: coordinate 0 on every mesh dimension that
    replicates it (plain tensors: every rank holds a copy; the caller picks one)."""
    if not isinstance(tensor, DTensor):
        return True
    coord = tensor.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coord, tensor.placements) if not isinstance(p, (Shard, _StridedShard)))


__all__ = ["global_indices", "runs", "local_boxes", "local_tensor", "box_slices", "intersect", "is_primary"]
