"""The forward context: the per-forward state every block may need, in one typed object.

`ForwardContext` travels from `Glm53Model.forward` to each decoder block (and MTP layer) instead of a growing list
of positional arguments: the padding mask, the top-k a "shared" indexer layer reuses, the per-layer sink for what
the training losses need (`LayerStats`), and slots reserved for a generation cache and packed-document
boundaries. Parallel hooks read it by field name (`ctx.stats`, never `args[3]`).

Legend: B batch, T time, J selected key slots per query (glm53/model/__init__.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LayerStats:
    """What one layer's forward records for the training losses (only when the model asks for it).

    Legend: B batch, T time, M tokens (B * T), E experts, k experts per token, P k-pools (glm53/model/__init__.py).
    """

    indexer: bool = False  # record the tensors the indexer KL loss needs
    router_logits: torch.Tensor | None = None  # [M, E] fp32, with gradient
    router_indices: torch.Tensor | None = None  # [M, k] chosen experts
    pool_mass: torch.Tensor | None = None  # [B, T, P] fp32 attention mass per pool (no gradient)
    index_scores: torch.Tensor | None = None  # [B, T, P] fp32 (full indexer layers; gradient to the indexer)
    candidate: torch.Tensor | None = None  # [B, T, P] bool pools the query may pick
    selected: torch.Tensor | None = None  # [B, T, P] bool pools it picked


@dataclass
class ForwardContext:
    """State shared by the blocks of one forward. `valid` is required; the rest default to "not in use"."""

    valid: torch.Tensor  # [B, T] bool: True at real tokens, False at padding
    shared_topk: torch.Tensor | None = None  # [B, T, J] the most recent "full" layer's selection
    collect_stats: bool = False  # give each layer a fresh LayerStats (training losses, expert loads)
    record_indexer: bool = False  # ... which also records the indexer KL loss's tensors
    stats: LayerStats | None = None  # this layer's sink (set per layer by `for_layer`)
    cache: Any = None  # reserved: a generation cache (glm53/generation)
    cu_seqlens: torch.Tensor | None = None  # reserved: [n_docs + 1] packed-document boundaries

    def for_layer(self) -> "ForwardContext":
        """A copy for one layer with its own fresh stats sink (None unless `collect_stats`)."""
        stats = LayerStats(indexer=self.record_indexer) if self.collect_stats else None
        return dataclasses.replace(self, stats=stats)


__all__ = ["ForwardContext", "LayerStats"]
