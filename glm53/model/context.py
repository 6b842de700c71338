"""The forward context: the per-forward state every block may need, in one typed object.

`ForwardContext` travels from `Glm53Model.forward` to each decoder block (and MTP layer) instead of a growing list
of positional arguments: the padding mask, the top-k a "shared" indexer layer reuses, the per-layer sink for what
the training losses need (`LayerStats`), the generation cache (model/cache.py), and packed-document boundaries
(`cu_seqlens` for the kernels, `segment_ids` for labels, MTP and the balance loss; model/packing.py). Parallel
hooks read it by field name (`ctx.stats`, never `args[3]`).

Legend: B batch, T time, J selected key slots per query (glm53/model/__init__.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # the annotation only: cache.py needs no context
    from .cache import GenerationCache


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


class SequenceShards(Protocol):
    """What a block needs to run on one contiguous slice of every sample's sequence (context parallelism).

    Implemented in glm53/parallel/cp_shards.py over a "cp" mesh dimension; the model only calls these methods, so it
    never imports torch.distributed. Rank `rank` of `size` holds global positions [offset, offset + local), of
    `total` in all. Every method is differentiable: gradients flow back to the rank that owns each position.
    """

    rank: int
    size: int
    offset: int  # global position of this rank's first token
    total: int  # global sequence length (every rank's slice summed)

    def all_gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's slice of `x` concatenated in rank order along `dim` (the gradient is summed back)."""
        ...

    def from_previous(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        """The last `width` positions of the previous rank's `x` along `dim` (zeros on rank 0): a causal halo."""
        ...

    def from_next(self, x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
        """The first `width` positions of the next rank's `x` along `dim` (zeros on the last rank)."""
        ...

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` stacked along a new leading dim [size, ...] (small summaries, e.g. KDA transitions)."""
        ...

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, without gradient (counts and loss values for reporting)."""
        ...


@dataclass
class ForwardContext:
    """State shared by the blocks of one forward. `valid` is required; the rest default to "not in use"."""

    valid: torch.Tensor  # [B, T] bool: True at real tokens, False at padding
    shared_topk: torch.Tensor | None = None  # [B, T, J] the most recent "full" layer's selection
    collect_stats: bool = False  # give each layer a fresh LayerStats (training losses, expert loads)
    record_indexer: bool = False  # ... which also records the indexer KL loss's tensors
    stats: LayerStats | None = None  # this layer's sink (set per layer by `for_layer`)
    cache: GenerationCache | None = None  # a generation cache the attention blocks read and extend (model/cache.py)
    # Packed documents (model/packing.py), both None when every row is one document:
    cu_seqlens: torch.Tensor | None = None  # [n_docs + 1] int64 boundaries over the flattened B * T tokens
    segment_ids: torch.Tensor | None = None  # [B, T] int64 document index of every token
    # Context parallelism: this rank holds one contiguous slice of every sequence (None: the whole sequence). Under
    # cp, `segment_ids` hold global document ids, set on every rank when any row is packed (model/key_sequence.py)
    cp: SequenceShards | None = None

    def for_layer(self) -> "ForwardContext":
        """A copy for one layer with its own fresh stats sink (None unless `collect_stats`)."""
        stats = LayerStats(indexer=self.record_indexer) if self.collect_stats else None
        return dataclasses.replace(self, stats=stats)


__all__ = ["ForwardContext", "LayerStats", "SequenceShards"]
