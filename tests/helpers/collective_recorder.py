"""A recording wrapper around torch.distributed's tensor collectives, with an optional simulated accelerator group.

`record_collectives(monkeypatch, simulate=None)` replaces the c10d functions glm53 may call (all_reduce, reduce,
broadcast, all_to_all_single, ...) with wrappers that record (collective, device type of each tensor argument,
device type of the group), where the group's device is what `glm53.parallel.comm.group_device` answers.
With simulate="meta", `group_device` answers the meta device for every group: the stand-in for a cuda/nccl
group on a CPU-only machine (meta tensors hold no data, as a CPU process cannot touch a GPU tensor's data either).
The collectives then run as a no-op (every simulated rank holds the same values), and a flag read back from a meta
tensor (`.item()`) reads 1, so code that makes its collective tensors on the host shows up as a "cpu" record
against a "meta" group: exactly the nccl export bug ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.parallel import comm

COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class _MetaScalars(TorchDispatchMode):
    """`.item()` of a meta tensor reads 1 (an all-ranks-agree flag that every simulated rank set)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_collectives(monkeypatch, simulate: str | None = None):
    """-> the list of records (name, [tensor device types], group device type), filled while the block runs."""
    records: list[tuple[str, list[str], str]] = []
    if simulate is not None:
        monkeypatch.setattr(comm, "group_device", lambda group=None: torch.device(simulate))
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            tensors = _tensors(args) + _tensors(list(kwargs.values()))
            records.append((_name, [t.device.type for t in tensors], comm.group_device(group).type))
            if simulate is not None:
                return None  # every simulated rank holds the same values: the reduction changes nothing
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)
    with _MetaScalars() if simulate is not None else contextlib.nullcontext():
        yield records


def misplaced(records) -> list:
    """The records whose tensors are not all on the group's device."""
    return [r for r in records if any(d != r[2] for d in r[1])]


__all__ = ["record_collectives", "misplaced", "COLLECTIVES"]
