"""Counting what a GPU run pays for beyond its math, on any device: host syncs and kernel launches.

`HostSyncs` (a TorchDispatchMode) counts the operations that make the host wait for the device: reading a value
(`.item()`, `bool(t)`, `int(t)`: aten._local_scalar_dense; `.tolist()`, which on the CPU dispatches nothing and
is counted by wrapping Tensor.tolist while the mode is active), ops whose output size depends on the data
(nonzero, masked_select, boolean-mask indexing and index_put, bincount, unique, repeat_interleave without
output_size) and device-to-host copies. On the CPU none of these costs anything, but each is one stall of the
stream on a GPU; counting them on the CPU predicts the GPU's count (same Python control flow).

`KernelLaunches` counts the ATen ops that would launch device work: every dispatched op except views and metadata
queries (a view changes strides, no kernel). Eager CUDA runs at least one kernel per such op (more for some
composite ones), so this is a lower bound on launches.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SIZE_FROM_DATA = {
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.argwhere.default: "nonzero",
}
_INDEX_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
_NO_KERNEL = {
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_same_size.default,
    aten.lift_fresh.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
}


def _sync_kind(func, args, kwargs) -> str | None:
    if func in (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default):
        return "item"
    if func in _SIZE_FROM_DATA:
        return _SIZE_FROM_DATA[func]
    if func in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
        return "bool_index"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if func in (aten._to_copy.default, aten.copy_.default):
        src = args[1] if func is aten.copy_.default else args[0]
        dst = args[0].device if func is aten.copy_.default else kwargs.get("device")
        if dst is not None and torch.device(dst).type == "cpu" and src.device.type not in ("cpu", "meta"):
            return "device_to_host"
    return None


def _is_custom(func) -> bool:
    return func.namespace not in ("aten", "prim", "prims")


def _run(mode: TorchDispatchMode, func, args, kwargs):
    """Run `func` as the mode sees it: a custom op (glm53's, any non-aten namespace) runs its device kernel
    (torch.library.get_kernel) with the mode pushed again, so the ops of its implementation are counted too (a
    mode is off while it handles an op, and calling the op itself would come back to the mode)."""
    if not _is_custom(func):
        return func(*args, **kwargs)
    device = next(t.device for t in pytree_tensors(args, kwargs))
    key = getattr(torch.DispatchKey, device.type.upper())
    impl = torch.library.get_kernel(func, key)
    with mode:
        return impl.call_boxed(torch.DispatchKeySet(key), *args, **kwargs)


def pytree_tensors(args, kwargs):
    """The tensors among a call's arguments (lists and tuples included), in order."""
    out = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out


class HostSyncs(TorchDispatchMode):
    """with HostSyncs() as syncs: ...; syncs.total, syncs.counts -> {kind: n} (kinds: item, tolist, nonzero,
    masked_select, bool_index, bincount, unique, repeat_interleave, device_to_host)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._patch = contextlib.ExitStack()
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        if self._depth == 0:
            original = torch.Tensor.tolist

            def tolist(t, *args, **kwargs):
                self.counts["tolist"] += 1
                return original(t, *args, **kwargs)

            torch.Tensor.tolist = tolist
            self._patch.callback(setattr, torch.Tensor, "tolist", original)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._patch.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None:
            self.counts[kind] += 1
        return _run(self, func, args, kwargs)


class KernelLaunches(TorchDispatchMode):
    """with KernelLaunches() as ops: ...; ops.total, ops.counts -> {aten op name: n} (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_custom(func):
            return _run(self, func, args, kwargs or {})  # its ATen ops are counted, not the op itself
        if not func.is_view and func not in _NO_KERNEL:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["HostSyncs", "KernelLaunches"]
