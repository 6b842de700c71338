"""Small helpers shared across packages."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, without floats."""
    return -(-a // b)


__all__ = ["ceil_div"]
