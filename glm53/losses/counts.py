"""How many terms each loss part averages over, counted from the batch alone (no forward needed).

Legend: B batch, T time, v views of the batch (1 + mtp_depth): view 0 is the main model, view d the MTP depth d.

Gradient accumulation and data parallelism need the denominators of the WHOLE global batch before the first
backward: the trainer counts every micro-batch with `count_loss_terms`, sums them, sums them over data-parallel
ranks (glm53.parallel.loss_denominators) and hands the result to every forward as `loss_denominators`. Each
loss part is then (this micro-batch's sum) / (global count), so the gradients summed over micro-batches and
ranks equal one forward's gradient on the global batch, for every part (lm, MTP, balance, z-loss, indexer KL).
The counts mirror the losses in losses.py exactly; tests/training/test_loss_normalisation.py checks that a
forward given its own counts reproduces its default (per-forward mean) losses part by part.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import Glm53Config
from ..model.indexer import pool_layout
from ..model.mtp import mtp_labels, shift_left
from ..model.packing import position_starts
from .parts import IGNORE_INDEX, next_token_targets


@dataclass
class LossCounts:
    """Loss denominators per view [v] (float32): see the module docstring for views."""

    targets: torch.Tensor  # next-token targets (labels != IGNORE_INDEX after the shift): lm (view 0), MTP depths
    sequences: torch.Tensor  # sequences with a valid token: the sequence-wise balance loss
    tokens: torch.Tensor  # valid tokens: the router z-loss
    indexer_rows: torch.Tensor  # valid queries with a candidate pool: the indexer KL loss

    def stacked(self) -> torch.Tensor:
        """[4, v]: every field in one tensor (one all-reduce)."""
        return torch.stack([getattr(self, f.name) for f in fields(self)])

    @classmethod
    def from_stacked(cls, t: torch.Tensor) -> "LossCounts":
        return cls(*t.unbind(0))

    def __add__(self, other: "LossCounts") -> "LossCounts":
        return LossCounts.from_stacked(self.stacked() + other.stacked())

    def __truediv__(self, divisor: float) -> "LossCounts":
        return LossCounts.from_stacked(self.stacked() / divisor)


def mtp_views(config: Glm53Config) -> int:
    """MTP depths that produce losses (0 without an MTP module)."""
    return config.mtp_depth if config.num_nextn_predict_layers > 0 else 0


def indexer_query_rows(valid: torch.Tensor, config: Glm53Config) -> torch.Tensor:
    """[B, T] bool: valid queries with at least one candidate pool (a complete pool of their row ending at or
    before them: Indexer.select's candidate mask, whose rows pool_kl averages over)."""
    sparse_picks_none = config.indexer_loss_mode == "sparse" and config.index_topk // config.index_kpool == 0
    if sparse_picks_none:  # the sparse target has no pools at all
        return torch.zeros_like(valid)
    B, T = valid.shape
    positions, token_valid, _ = pool_layout(valid, config.index_kpool)
    ends = positions[..., -1].masked_fill(~token_valid.all(-1), T)  # [B, P]; incomplete pools never end
    first_end = ends.min(-1).values if ends.shape[-1] else torch.full((B,), T, device=valid.device)
    return valid & (torch.arange(T, device=valid.device)[None, :] >= first_end[:, None])


def count_loss_terms(
    config: Glm53Config, labels: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor | None = None
) -> LossCounts:
    """The denominators of one batch's losses: labels [B, T] (aligned with input_ids), valid [B, T] bool.

    With `position_ids` [B, T] (packed documents: they restart at 0 at each document), every document counts as
    if it were alone, the semantics of a packed forward: the sum of each document's own counts.
    """
    if position_ids is not None:
        return _count_documents(config, labels, valid, position_ids)
    views = []
    for d in range(mtp_views(config) + 1):
        labels_d = labels if d == 0 else mtp_labels(labels, d, IGNORE_INDEX)
        valid_d = valid if d == 0 else valid & shift_left(valid, d, False)  # MultiTokenPrediction's validity
        views.append(
            torch.stack(
                [
                    (next_token_targets(labels_d) != IGNORE_INDEX).sum(),
                    valid_d.any(-1).sum(),
                    valid_d.sum(),
                    indexer_query_rows(valid_d, config).sum(),
                ]
            )
        )
    return LossCounts.from_stacked(torch.stack(views, dim=1).float())


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each document: a document starts where position_ids does not continue the
    previous position (at 0 in transformers' padding-free convention). position_ids [B, T]."""
    starts = position_starts(position_ids.cpu())  # NOTE: syncs
    spans = []
    for row in starts:
        edges = row.nonzero().flatten().tolist() + [row.numel()]
        spans.append(list(zip(edges, edges[1:])))
    return spans


def _count_documents(
    config: Glm53Config, labels: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor
) -> LossCounts:
    if position_ids.shape != labels.shape:
        raise ValueError(
            f"position_ids must have shape {tuple(labels.shape)} like labels, got {tuple(position_ids.shape)}"
        )
    total = None
    for b, spans in enumerate(document_spans(position_ids)):  # counting only: a loop over documents is cheap
        for start, end in spans:
            doc = count_loss_terms(config, labels[b : b + 1, start:end], valid[b : b + 1, start:end])
            total = doc if total is None else total + doc
    return total


__all__ = ["LossCounts", "count_loss_terms", "document_spans", "indexer_query_rows", "mtp_views"]
