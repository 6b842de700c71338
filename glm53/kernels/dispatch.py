"""One explicit, logged choice of implementation per op.

Each op in `glm53/kernels/` registers its implementations by what they are: "reference" is the slow,
obviously-correct loop form, "fast" the plain-PyTorch kernel models run by default, and other names describe
themselves ("chunk_reference": KDA's chunked form written for clarity, "padded": the MoE experts as one padded
batched matmul). `kernel(op)` returns the chosen callable: "fast" unless a backend was forced; the choice is
logged once per (op, backend), and an unknown op or backend raises. Tests force a backend with the scoped
`use_backend(...)` context (it restores the previous choice on exit); `set_backend` is the global form.
Model code does not look ops up by name on every call: it holds a `KernelOp` per op (`kernel_op("rms_norm")`, made
once at import), resolved when made and again whenever `set_backend` / `use_backend` change that op's choice, so a
call is one attribute read (`KernelOp.fn`) and a scoped forcing still reaches every module.
A handle may name the backend its call site prefers (`kernel_op("moe_experts", prefer="few_token")`: the generation
cache path's host-read-free forms): that backend replaces the default for this handle only; a forced or per-device
choice still wins over it, so `use_backend("reference")` reaches these call sites too.
The choice of kernel never changes numerics settings of a module (those are explicit module attributes).

Device backends: a backend that runs on one device type only (a Triton/CUDA kernel: "fla", flash-linear-
attention's chunk_kda for "kda", registered by kernels/kda/fla_backend.py when that package is installed; the
same slot takes a sparse-latent attention kernel for "sparse_mqa_attention") is chosen explicitly per (op, device
type) with `set_device_backend` / `use_device_backend`, never picked up by default. `resolve(op, device_type)`
names the backend a call on that device runs: a process-wide `use_backend` choice first, then the per-device
choice, then the default. With a per-device choice in place `kernel(op)` returns a callable that resolves on each
call from its first tensor argument's device (so a module that resolved its kernels once still follows the
device its inputs are on); each (op, device type, backend) is logged the first time it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger("glm53.kernels")

DEFAULT_BACKEND = "fast"
_REGISTRY: dict[str, dict[str, Callable]] = {}
_FORCED: dict[str, str] = {}
_LOGGED: set[tuple[str, str]] = set()
_HANDLES: dict[str, list["KernelOp"]] = {}  # every KernelOp made, per op: set_backend re-resolves them


class KernelOp:
    """One op's chosen implementation, held by the code that calls it: `op(*args)` calls `op.fn`."""

    def __init__(self, op: str, prefer: str | None = None) -> None:
        if prefer is not None and prefer not in backends(op):  # raises on an unknown op
            raise ValueError(f"unknown backend {prefer!r} for kernel op {op!r}; registered: {backends(op)}")
        self.op, self.prefer = op, prefer
        self.fn = kernel(op, prefer)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"KernelOp({self.op!r}: {chosen_backend(self.op, self.prefer)})"


def kernel_op(op: str, prefer: str | None = None) -> KernelOp:
    """A handle on `op`'s implementation (`prefer`: this call site's backend instead of the default), kept current
    by `set_backend` (and so by `use_backend`)."""
    handle = KernelOp(op, prefer)
    _HANDLES.setdefault(op, []).append(handle)
    return handle


def register(op: str, backend: str, fn: Callable) -> Callable:
    _REGISTRY.setdefault(op, {})[backend] = fn
    return fn


def ops() -> list[str]:
    return sorted(_REGISTRY)


def backends(op: str) -> list[str]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown kernel op {op!r}; known: {ops()}")
    return sorted(_REGISTRY[op])


def set_backend(op: str, backend: str | None) -> None:
    """Force `backend` for `op` process-wide (None restores the default); prefer the scoped `use_backend`."""
    if backend is None:
        _FORCED.pop(op, None)
    elif backend not in backends(op):
        raise ValueError(f"unknown backend {backend!r} for kernel op {op!r}; registered: {backends(op)}")
    else:
        _FORCED[op] = backend
    for handle in _HANDLES.get(op, ()):
        handle.fn = kernel(op, handle.prefer)


def chosen_backend(op: str, prefer: str | None = None) -> str:
    """The backend `kernel(op, prefer)` returns: the forced one, else `prefer`, else "fast" (else "reference" for
    ops without one)."""
    available = backends(op)
    if op in _FORCED:
        return _FORCED[op]
    if prefer is not None:
        return prefer
    return DEFAULT_BACKEND if DEFAULT_BACKEND in available else "reference"


def kernel(op: str, prefer: str | None = None) -> Callable:
    if op not in _FORCED and any(key[0] == op for key in _DEVICE_CHOICE):
        return _device_kernel(op, prefer)
    name = chosen_backend(op, prefer)
    # torch.compile traces this call: logging would break the graph, so the first eager call logs instead. The
    # compiling test comes first: reading _LOGGED while tracing would guard the graph on the set's contents, and
    # the next eager call's add would recompile every block.
    if not torch.compiler.is_compiling() and (op, name) not in _LOGGED:
        _LOGGED.add((op, name))
        logger.info("glm53 kernel %s: using the %s implementation", op, name)
    return _REGISTRY[op][name]


# (op, device type) -> backend chosen for calls on that device (set_device_backend)
_DEVICE_CHOICE: dict[tuple[str, str], str] = {}
_DEVICE_KERNELS: dict[tuple[str, str | None], Callable] = {}


def set_device_backend(op: str, device_type: str, backend: str | None) -> None:
    """Run `backend` for `op` on tensors of `device_type` ("cuda", ...); None removes the choice."""
    if backend is None:
        _DEVICE_CHOICE.pop((op, device_type), None)
    else:
        if backend not in backends(op):
            raise ValueError(
                f"unknown backend {backend!r} for kernel op {op!r}; registered: {backends(op)} (a "
                f"device backend registers only where its package is installed)"
            )
        torch.device(device_type)  # raises on an unknown device type
        _DEVICE_CHOICE[(op, device_type)] = backend
    for handle in _HANDLES.get(op, ()):  # the modules' handles follow the choice
        handle.fn = kernel(op, handle.prefer)


@contextlib.contextmanager
def use_device_backend(op: str, device_type: str, backend: str) -> Iterator[None]:
    """`set_device_backend` inside the block, restoring the previous choice on exit."""
    saved = _DEVICE_CHOICE.get((op, device_type))
    set_device_backend(op, device_type, backend)
    try:
        yield
    finally:
        set_device_backend(op, device_type, saved)


def resolve(op: str, device_type: str, prefer: str | None = None) -> str:
    """The backend a call of `op` on `device_type` tensors runs (see the module docstring for the order)."""
    if op in _FORCED:
        return _FORCED[op]
    return _DEVICE_CHOICE.get((op, device_type)) or chosen_backend(op, prefer)


def _first_device_type(args, kwargs) -> str:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _device_kernel(op: str, prefer: str | None = None) -> Callable:
    """The callable `kernel(op, prefer)` returns while `op` has a per-device choice: resolves on every call."""
    if (op, prefer) not in _DEVICE_KERNELS:

        def call(*args, **kwargs):
            device_type = _first_device_type(args, kwargs)
            name = resolve(op, device_type, prefer)
            if not torch.compiler.is_compiling() and (op, device_type, name) not in _LOGGED:
                _LOGGED.add((op, device_type, name))
                logger.info("glm53 kernel %s on %s: using the %s implementation", op, device_type, name)
            return _REGISTRY[op][name](*args, **kwargs)

        call.__name__ = f"{op}_by_device"
        _DEVICE_KERNELS[(op, prefer)] = call
    return _DEVICE_KERNELS[(op, prefer)]


@contextlib.contextmanager
def use_backend(backend: str, ops: list[str] | None = None) -> Iterator[None]:
    """Force `backend` for `ops` inside the block, restoring the previous choices on exit.

    With `ops` None every registered op that has `backend` is forced (a backend no op has raises: a misspelt
    name would otherwise force nothing); a named op without it raises.
    """
    if isinstance(ops, str):  # list("kda") would name the ops 'k', 'd', 'a'
        raise TypeError(f"ops must be a list of op names or None, got the string {ops!r}; pass [{ops!r}]")
    names = [op for op in _REGISTRY if backend in _REGISTRY[op]] if ops is None else list(ops)
    if not names and ops is None:
        known = sorted({name for impls in _REGISTRY.values() for name in impls})
        raise ValueError(f"unknown backend {backend!r}: no kernel op registers it; registered: {known}")
    saved = {op: _FORCED.get(op) for op in names}
    try:
        for op in names:
            set_backend(op, backend)
        yield
    finally:
        for op, prev in saved.items():
            set_backend(op, prev)
