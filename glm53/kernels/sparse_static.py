"""The "static" backends of the two sparse attention ops: the fast forms planned from shapes alone, no host read.

The fast forms (kernels/sparse_attention.py) read each chunk's selected key span on the host once per call (one
`.tolist()`) to run the chunks whose keys are close together as masked-dense GEMMs over that span. On a generation
cache the key axis is the cache's fixed length S and a decode or verify step has few queries, so the span buys
little and the read is one stall of the device per MLA layer per token (and an op a CUDA graph cannot capture).
The static plan gives every chunk the whole key axis [0, S): a chunk runs masked-dense over all S keys when
S <= DENSE_SPAN_RATIO * J (PER_HEAD_DENSE_SPAN_RATIO per head), the measured ratio at which dense work costs what the
gather does, and the gather form otherwise. The same chunk code, the same sums over the same selected keys (only
the rounding order of a dense chunk's softmax differs, over more masked-out zeros), and the same hand-written
backward. The generation cache path prefers these (model/mla.py); `use_backend(...)` still overrides them.

Signatures as in kernels/sparse_attention.py. The ops carry no `cudagraph_unsafe` tag: they read nothing on the
host, so torch.compile(mode="reduce-overhead") captures them.
"""

from __future__ import annotations

import torch

from .dispatch import register
from .sparse_attention import absorbed_op, per_head_op, same_document_only


def sparse_attention_static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-head fast form with every chunk spanning all keys (no host read); same signature."""
    if cu_seqlens is not None:
        topk_indices = same_document_only(topk_indices, cu_seqlens, k.shape[1])
    return _sparse_static_op(q, k, v, topk_indices, scale)


def sparse_mqa_attention_static(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The absorbed fast form with every chunk spanning all keys (no host read); same signature."""
    if cu_seqlens is not None:
        topk_indices = same_document_only(topk_indices, cu_seqlens, kv.shape[1])
    return _mqa_static_op(q, kv, topk_indices, scale)


register("sparse_attention", "static", sparse_attention_static)
register("sparse_mqa_attention", "static", sparse_mqa_attention_static)


_sparse_static_op = per_head_op("sparse_attention_static", True, ())
_mqa_static_op = absorbed_op("sparse_mqa_attention_static", True, ())

__all__ = ["sparse_attention_static", "sparse_mqa_attention_static"]
