"""Bytes communicated by the collectives a rank issues, counted at dispatch (`CommBytes`, a TorchDispatchMode).

Legend: W ranks in the collective's group; bytes are what leaves this rank on a ring / pairwise algorithm:
all-gather (W - 1) x its input shard, reduce-scatter (W - 1) / W x its input, all-reduce 2 (W - 1) / W x the
tensor, all-to-all its input minus the part it keeps (its own split). Counted per op name, for FSDP2's c10d
calls and the functional collectives (`all_to_all_single_autograd`) alike; nothing is sent differently.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

c10d = torch.ops.c10d
funcol = torch.ops._c10d_functional


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return t.numel() * t.element_size()


def _group_of(arg):
    """(size, rank) of a collective's group: a ProcessGroup script object or a functional group name."""
    if isinstance(arg, str):
        group = dist.distributed_c10d._resolve_process_group(arg)
    else:  # the c10d ops carry the group boxed as a TorchScript object
        group = dist.ProcessGroup.unbox(arg)
    return group.size(), group.rank()


def _all_to_all(inp: torch.Tensor, input_splits, group) -> int:
    size, rank = _group_of(group)
    row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
    own = input_splits[rank] * row if input_splits else _bytes(inp) // size
    return _bytes(inp) - own


def _count(func, args) -> tuple[str, int] | None:
    """(kind, bytes sent) of a collective call, None for any other op."""
    if func in (c10d._allgather_base_.default,):
        return "all_gather", _bytes(args[1]) * (_group_of(args[2])[0] - 1)
    if func in (c10d.allgather_into_tensor_coalesced_.default,):
        return "all_gather", _bytes(args[1]) * (_group_of(args[2])[0] - 1)
    if func in (funcol.all_gather_into_tensor.default,):
        return "all_gather", _bytes(args[0]) * (args[1] - 1)
    if func in (c10d._reduce_scatter_base_.default, c10d.reduce_scatter_tensor_coalesced_.default):
        W = _group_of(args[2])[0]
        return "reduce_scatter", _bytes(args[1]) * (W - 1) // W
    if func in (funcol.reduce_scatter_tensor.default,):
        W = args[2]
        return "reduce_scatter", _bytes(args[0]) * (W - 1) // W
    if func in (c10d.allreduce_.default,):
        W = _group_of(args[1])[0]
        return "all_reduce", 2 * _bytes(args[0]) * (W - 1) // W
    if func in (funcol.all_reduce.default,):
        W = _group_of(args[2])[0]
        return "all_reduce", 2 * _bytes(args[0]) * (W - 1) // W
    if func in (c10d.alltoall_base_.default,):
        return "all_to_all", _all_to_all(args[1], list(args[4]), args[2])
    if func in (funcol.all_to_all_single.default,):
        return "all_to_all", _all_to_all(args[0], list(args[2]), args[3])
    return None


class CommBytes(TorchDispatchMode):
    """with CommBytes() as comm: ...; comm.bytes -> {kind: bytes sent by this rank}, comm.calls -> {kind: n}."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counted = _count(func, args)
        if counted is not None:
            self.bytes[counted[0]] += counted[1]
            self.calls[counted[0]] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["CommBytes"]
