"""argparse types for the command lines (train, demo, generate, tools): numbers and paths checked where parsed.

No tensors here. A bad value becomes argparse's usage error (exit status 2, the flag named), never a traceback
or a run with a negative learning rate.
"""

from __future__ import annotations

import argparse
import math
import os


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

# A sequence of one token has no next token to predict: every loss would be empty.
sequence_length = _at_least(_int, 2)


def thread_count(text: str) -> int:
    """An argparse type: CPU threads in [1, this machine's CPU count] (torch crashes on absurd counts)."""
    value, cpus = positive_int(text), os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be <= {cpus} (this machine's CPU count), got {value}")
    return value


def writable_target(flag: str, path: str) -> str | None:
    """Why `path` cannot become a directory written at the end of a run (None if it can): the nearest existing
    ancestor must be a writable directory. Checked before the run, so a bad path costs no training."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: {parent} is not writable"
    return None


MAX_SEED = 2**32 - 1  # the trainer derives per-rank seeds from it (seed * 1_000_003 + rank): must fit int64


def existing_dir(text: str) -> str:
    """An argparse type: a path that is an existing directory (a checkpoint or tokenizer directory)."""
    if not os.path.isdir(text):
        why = "not a directory" if os.path.exists(text) else "no such directory"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def seed_int(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


__all__ = ["existing_dir", "sequence_length", "thread_count", "writable_target", "positive_int", "non_negative_int",
           "seed_int", "positive_float", "non_negative_float"]
