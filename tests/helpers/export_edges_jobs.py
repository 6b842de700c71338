"""Gloo jobs for the exporter's shared directory (tests/parallel/test_export.py), run on every rank.

Legend: a run directory is written by every rank inside `shared_atomic_directory` and renamed into place by rank 0.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from glm53.parallel.export import shared_atomic_directory


def failing_write(path: str, failing_rank: int) -> str:
    """Every rank writes one file into the shared temporary directory; `failing_rank` then raises.
    -> what this rank saw leave the block ('' when nothing was raised)."""
    rank = dist.get_rank()
    try:
        with shared_atomic_directory(path) as tmp:
            with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
                f.write("partial")
            if rank == failing_rank:
                raise ValueError(f"rank {rank} failed")
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


__all__ = ["failing_write"]
