"""Small helpers shared across packages."""

from __future__ import annotations

from typing import Any


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, without floats."""
    return -(-a // b)


def is_int(value: Any) -> bool:
    """A real int: `True` (JSON `true`) is a bool and is refused."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float (where a float is meant); bools and strings are refused."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["ceil_div", "is_int", "is_number"]
