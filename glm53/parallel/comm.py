"""Where a collective's tensors live (`group_device` and the helpers below, used for every collective glm53 issues
on a tensor it makes itself), and the bytes the collectives a rank issues send (`CommBytes`, a TorchDispatchMode).

The device rule: a collective on a group runs on that group's device, the current accelerator for a backend bound
to one (nccl, xccl, ...; the device `init_mesh` binds with `device_id`) and the CPU for gloo and the fake backend.
nccl has no CPU path ("No backend type associated with device type cpu"), so a flag or count made with
`torch.tensor(...)` must be moved there first: `all_reduce`, `reduce_`, `all_ranks_agree` and `all_to_all_single`
below move their tensor to `group_device(group)`, run the collective there and hand back a tensor on the caller's
device. Activations (already on the model's device, which is the mesh's) pass through unchanged.

Legend: W ranks in the collective's group; bytes are what leaves this rank on a ring / pairwise algorithm:
all-gather (W - 1) x its input shard, reduce-scatter (W - 1) / W x its input, all-reduce 2 (W - 1) / W x the
tensor, all-to-all its input minus the part it keeps (its own split). Counted per op name, for FSDP2's c10d
calls and the functional collectives (`all_to_all_single_autograd`) alike; nothing is sent differently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

c10d = torch.ops.c10d
funcol = torch.ops._c10d_functional


_CPU_BACKENDS = ("gloo", "fake", "mpi")


def _device_of_backend(backend: str) -> torch.device:
    """ "gloo" -> cpu; "nccl" -> the current accelerator; "cpu:gloo,cuda:nccl" -> the accelerator (the tensors a
    caller makes for a mixed group go where the data collectives run)."""
    parts = [p.split(":", 1) for p in str(backend).lower().split(",")]
    if all(len(p) == 2 for p in parts):
        accelerated = [device for device, _ in parts if device != "cpu"]
        return _accelerator() if accelerated else torch.device("cpu")
    return torch.device("cpu") if str(backend).lower() in _CPU_BACKENDS else _accelerator()


def _accelerator() -> torch.device:
    accel = torch.accelerator.current_accelerator()
    if accel is None:
        raise RuntimeError(
            "the process group's backend needs an accelerator, but torch sees none (start the run "
            "with --device cpu, which uses gloo)"
        )
    return torch.device(accel.type, torch.accelerator.current_device_index())


def group_device(group=None) -> torch.device:
    """The device the collectives of `group` (None: the default group) take their tensors on."""
    return _device_of_backend(dist.get_backend(group))


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """`t` reduced over `group`, out of place, on `t`'s device (the collective runs on the group's device)."""
    on_group = t.detach().to(group_device(group), copy=True)
    dist.all_reduce(on_group, op=op, group=group)
    return on_group.to(t.device)


def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """`t` reduced over `group` in place (copied through the group's device when it lives elsewhere)."""
    if t.device == group_device(group):
        dist.all_reduce(t, op=op, group=group)
        return t
    return t.copy_(all_reduce(t, op, group))


def reduce_(t: torch.Tensor, dst: int, group=None) -> torch.Tensor:
    """`t` summed onto global rank `dst` in place (other ranks' `t` are left as the backend leaves them)."""
    if t.device == group_device(group):
        dist.reduce(t, dst=dst, group=group)
        return t
    on_group = t.to(group_device(group), copy=True)
    dist.reduce(on_group, dst=dst, group=group)
    return t.copy_(on_group)


def all_ranks_agree(ok: bool, group=None) -> bool:
    """True when every rank of `group` passed ok=True (MIN over the ranks; one collective on the group device)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def all_to_all_single(output: torch.Tensor, inp: torch.Tensor, group=None) -> torch.Tensor:
    """Equal-split `all_to_all_single` of `inp` into `output` (both moved through the group's device if needed)."""
    device = group_device(group)
    if output.device == device and inp.device == device:
        dist.all_to_all_single(output, inp, group=group)
        return output
    out = torch.empty_like(output, device=device)
    dist.all_to_all_single(out, inp.to(device), group=group)
    return output.copy_(out)


def in_place_all_reduce(group) -> Callable[[torch.Tensor], None]:
    """A one-argument in-place sum over `group` (for callers taking an all-reduce callback)."""

    def reduce(t: torch.Tensor) -> None:
        all_reduce_(t, group=group)

    return reduce


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


__all__ = [
    "CommBytes",
    "group_device",
    "all_reduce",
    "all_reduce_",
    "reduce_",
    "all_ranks_agree",
    "all_to_all_single",
    "in_place_all_reduce",
]
