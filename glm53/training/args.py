"""argparse types for the train command line: numbers checked where they are parsed.

No tensors here. A bad value becomes argparse's usage error (exit status 2, the flag named), never a traceback
or a run with a negative learning rate.
"""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _at_least(parse, low, inclusive: bool = True):
    """An argparse type: `parse(text)` (a finite int or float), >= low (or > low), else a usage error."""

    def check(text: str):
        value = parse(text)
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value

    return check


positive_int = _at_least(_int, 1)
non_negative_int = _at_least(_int, 0)
positive_float = _at_least(_float, 0, inclusive=False)
non_negative_float = _at_least(_float, 0)

MAX_SEED = 2**32 - 1  # the trainer derives per-rank seeds from it (seed * 1_000_003 + rank): must fit int64


def seed_int(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


__all__ = ["positive_int", "non_negative_int", "seed_int", "positive_float", "non_negative_float"]
