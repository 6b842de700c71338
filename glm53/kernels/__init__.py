"""Numerics-critical ops, each with a slow obviously-correct reference beside its fast version.

`kernel(op)` returns the implementation in use (see `dispatch.py`); every module calls ops through it, so a test
can force the reference with `use_backend("reference")`.
"""

from . import (  # noqa: F401  (registers the implementations)
    conv,
    hc_collapse,
    hc_mix,
    hc_project,
    indexer_scores,
    indexer_topk,
    kda,
    linear_cross_entropy,
    moe,
    rms_norm,
    sinkhorn,
    sparse_attention,
    vision_attention,
)
from .dispatch import backends, chosen_backend, kernel, ops, set_backend, use_backend

__all__ = ["backends", "chosen_backend", "kernel", "ops", "set_backend", "use_backend"]
