"""Context parallelism's collectives: one contiguous slice of every sequence per rank of a "cp" mesh dimension.

`CpShards` implements `glm53.model.context.SequenceShards` (the only interface the model sees) with torch's
functional collectives, whose autograd sends every gradient back to the rank that owns the position:
all-gather's backward is a reduce-scatter (sum). Halos and small summaries are all-gathers of the few positions
needed; at the widths involved (a conv's kernel - 1 tokens, K x K per KDA head) that costs less than a
point-to-point pair and needs no send/recv ordering.

Legend (glm53/model/__init__.py): B batch, T time.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


def _all_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[size * x.shape[0], ...] with gradient (summed back over the ranks)."""
    out = funcol.all_gather_single_autograd(x.contiguous(), 0, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class CpShards:
    """This rank's view of the cp dimension of `mesh`, for one forward over `local` positions per sequence."""

    def __init__(self, mesh: DeviceMesh, local: int, total: int | None = None, offset: int | None = None) -> None:
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        self.local = local
        self.offset = self.rank * local if offset is None else offset
        self.total = self.size * local if total is None else total

    def all_gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        gathered = _all_gather(x.movedim(dim, 0), self.group, self.size)  # [size * local, ...] (needs equal slices)
        return gathered.movedim(0, dim)

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        return _all_gather(x[None], self.group, self.size)

    def from_previous(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        tail = x.narrow(dim, x.shape[dim] - width, width)
        every = self.stack(tail)  # [size, ...]
        return every[self.rank - 1] if self.rank > 0 else torch.zeros_like(tail) + 0 * every[0]

    def from_next(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        head = x.narrow(dim, 0, width)
        every = self.stack(head)
        return every[self.rank + 1] if self.rank + 1 < self.size else torch.zeros_like(head) + 0 * every[0]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        out = funcol.all_reduce(x.detach().contiguous(), "sum", self.group)
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


__all__ = ["CpShards"]
