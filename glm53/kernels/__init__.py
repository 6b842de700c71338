"""Numerics-critical ops, each with a slow obviously-correct reference beside its fast version.

`kernel(op)` returns the implementation in use (see `dispatch.py`); model code holds a `kernel_op(op)` handle per
op instead (resolved once, kept current by `use_backend`), so a test can force the reference with
`use_backend("reference")` either way.
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
    sparse_static,
    vision_attention,
)
from .dispatch import KernelOp, backends, chosen_backend, kernel, kernel_op, ops, set_backend, use_backend

__all__ = ["KernelOp", "backends", "chosen_backend", "kernel", "kernel_op", "ops", "set_backend", "use_backend"]
