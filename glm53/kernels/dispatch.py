"""One explicit, logged choice of implementation per op.

Each op in `glm53/kernels/` registers its implementations by name ("reference" is the slow, obviously-correct
loop form; "eager" the fast plain-PyTorch one). `kernel(op)` returns the chosen callable; the choice is made
once per op (the fastest registered unless `set_backend` says otherwise), logged once, and an unknown op or
backend raises. Tests force the reference with `set_backend(op, "reference")` or the `use_backend` context.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

logger = logging.getLogger("glm53.kernels")

# Preference order when no backend was set explicitly.
_PREFERENCE = ("eager", "chunk", "reference")
_REGISTRY: dict[str, dict[str, Callable]] = {}
_CHOSEN: dict[str, str] = {}
_LOGGED: set[tuple[str, str]] = set()


def register(op: str, backend: str, fn: Callable) -> Callable:
    _REGISTRY.setdefault(op, {})[backend] = fn
    return fn


def backends(op: str) -> list[str]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(_REGISTRY)}")
    return sorted(_REGISTRY[op])


def set_backend(op: str, backend: str | None) -> None:
    """Choose `backend` for `op` (None restores the default choice)."""
    if backend is None:
        _CHOSEN.pop(op, None)
        return
    if backend not in backends(op):
        raise ValueError(f"unknown backend {backend!r} for kernel op {op!r}; registered: {backends(op)}")
    _CHOSEN[op] = backend


def chosen_backend(op: str) -> str:
    available = backends(op)
    if op in _CHOSEN:
        return _CHOSEN[op]
    for name in _PREFERENCE:
        if name in available:
            return name
    return available[0]


def kernel(op: str) -> Callable:
    name = chosen_backend(op)
    if (op, name) not in _LOGGED:
        _LOGGED.add((op, name))
        logger.info("glm53 kernel %s: using the %s implementation", op, name)
    return _REGISTRY[op][name]


@contextlib.contextmanager
def use_backend(backend: str, ops: list[str] | None = None) -> Iterator[None]:
    """Temporarily force `backend` for `ops` (all registered ops by default) that have it."""
    ops = list(_REGISTRY) if ops is None else ops
    saved = {op: _CHOSEN.get(op) for op in ops}
    try:
        for op in ops:
            if backend in backends(op):
                set_backend(op, backend)
        yield
    finally:
        for op, prev in saved.items():
            set_backend(op, prev)
