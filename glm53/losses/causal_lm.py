"""Glm53ForCausalLM: the computing model (glm53.model.Glm53LMHeadModel) scored by its training losses.

Legend: B batch, T time, D model width, vocab the vocabulary size.
The transformers-style call `model(input_ids, labels=labels)` runs the computing model with the statistics the
losses need, then `add_causal_lm_losses` turns its LMOutput into `.loss` and its parts (docs/training.md):
    loss = lm + mtp_loss_weight * mtp + aux + indexer_loss_weight * indexer
Head and loss: the next-token and MTP losses run the head and the cross-entropy as one chunked op
(`causal_lm_head_loss`, glm53/kernels/linear_cross_entropy.py) and never hold [B, T, vocab] logits. With labels,
a packed document's last token predicts nothing. Without labels the call is the computing model's forward.
This module sits above glm53.model (which imports nothing from glm53.losses) and below glm53.parallel and
glm53.training (tests/test_layout.py keeps the package graph so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.context import LayerStats, SequenceShards
from ..model.cp import across_ranks, sharded_targets
from ..model.inputs import check_token_ids, padding_mask
from ..model.model import Glm53LMHeadModel
from ..model.mtp import mtp_labels
from ..model.packing import document_labels
from .counts import LossCounts, count_loss_terms
from .indexer_kl import indexer_kl_terms
from .parts import IGNORE_INDEX, causal_lm_head_loss, head_target_loss, router_aux_loss


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, vocab] in the head's dtype; None with return_logits=False
    loss: torch.Tensor | None = None  # lm + mtp_loss_weight * mtp + aux + indexer_loss_weight * indexer
    lm_loss: torch.Tensor | None = None  # next-token cross-entropy alone
    mtp_loss: torch.Tensor | None = None  # MTP cross-entropy, mean over depths (None without an MTP module)
    aux_loss: torch.Tensor | None = None  # coef-weighted balance + z-loss, mean over MoE layers (None if both off)
    indexer_loss: torch.Tensor | None = None  # indexer KL, mean over full indexers (None when its weight is 0)
    last_hidden_state: torch.Tensor | None = None  # [B, T, D] after the final norm


class Glm53ForCausalLM(Glm53LMHeadModel):
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        loss_denominators: LossCounts | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool = True,
        cp: SequenceShards | None = None,
    ) -> CausalLMOutput:
        """`return_logits` (default True): `out.logits = lm_head(last hidden state)` [B, T, vocab], in the graph as
        always; with False, `out.logits` is None and no [B, T, vocab] tensor is made (training loops pass False).
        The losses never read `out.logits`: with labels and return_logits=True the logits are computed beside the
        chunked loss, so a caller can still use them (with gradient), at the cost of their memory.
        With labels, the losses; each part is this forward's mean unless `loss_denominators` (the counts of a
        whole global batch, `loss_counts` summed over micro-batches and ranks) says what to divide its sum by.
        Packed documents: `cu_seqlens` [n_docs + 1] over the flattened tokens or `position_ids` [B, T] restarting
        at 0 per document (model/packing.py); `loss_counts(..., position_ids)` gives their denominators.
        Context parallelism (`cp`, model/cp.py): the inputs are this rank's slice of every sequence, `labels` its
        slice of the next-token targets (shifted over the whole sequence) and `loss_denominators` are required;
        glm53.parallel.context_parallel_inputs makes all of them. Every loss part is then the whole batch's."""
        scored = labels is not None
        if scored:  # before the forward: a bad label would otherwise fail only in the loss
            check_token_ids("labels", labels, self.config.vocab_size, self.lm_head.weight.device, ignore=IGNORE_INDEX)
        if loss_denominators is not None and not isinstance(loss_denominators, LossCounts):
            raise TypeError(
                f"loss_denominators must be a LossCounts (model.loss_counts, summed over micro-batches "
                f"and ranks) or None, got {type(loss_denominators).__name__}"
            )
        if cp is not None and scored and loss_denominators is None:
            raise ValueError(
                "under context parallelism (cp) pass loss_denominators: the counts of the whole "
                "sequences (glm53.parallel.context_parallel_inputs computes them)"
            )
        run = super().forward(
            input_ids,
            attention_mask,
            inputs_embeds,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            return_logits=return_logits,
            cp=cp,
            collect_stats=scored,
            run_mtp=scored,
            record_indexer=scored and self.config.indexer_loss_weight > 0,
        )
        out = CausalLMOutput(logits=run.logits, last_hidden_state=run.last_hidden_state)
        if scored:
            ctx = run.ctx
            n_docs = None if ctx.cu_seqlens is None else ctx.cu_seqlens.shape[0] - 1  # a size from the shape
            self._add_losses(out, labels, ctx.valid, run.stats, run.mtp, loss_denominators, ctx.segment_ids, cp, n_docs)
        return out

    def _add_losses(
        self,
        out: CausalLMOutput,
        labels: torch.Tensor,
        valid: torch.Tensor,
        stats: list[LayerStats],
        mtp_runs: list,
        den: LossCounts | None,
        segments: torch.Tensor | None = None,
        cp: SequenceShards | None = None,
        num_documents: int | None = None,
    ) -> None:
        add_causal_lm_losses(out, self, labels, valid, stats, mtp_runs, den, segments, cp, num_documents)

    def loss_counts(
        self, labels: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> LossCounts:
        """How many terms each loss part of a forward on the same inputs averages over (no forward needed);
        with position_ids, each packed document counts as if it were alone."""
        device = labels.device if isinstance(labels, torch.Tensor) else torch.device("cpu")  # counts need no model
        check_token_ids("labels", labels, self.config.vocab_size, device, ignore=IGNORE_INDEX)
        valid = padding_mask(attention_mask, labels.shape, labels.device)
        return count_loss_terms(self.config, labels, valid, position_ids)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Greedy or sampled continuation [B, T + new] of a left-padded batch (see glm53.generation.generate)."""
        from ..generation.loop import generate  # generation imports the computing model only, never this module

        return generate(self, input_ids, attention_mask, **kwargs)


def view_loss(
    model: Glm53LMHeadModel,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    d: int,
    den: LossCounts | None,
    segments: torch.Tensor | None,
    cp: SequenceShards | None,
) -> torch.Tensor:
    """The cross-entropy of view d (0: next token, d: MTP depth d) from the hidden state the head reads [B, T, D].

    `segments` [B, T] (packed documents): no label crosses a document boundary. `cp`: `labels` are next-token
    targets of this slice (model/cp.py `sharded_targets`)."""
    num_targets = None if den is None else den.targets[d]
    if cp is not None:
        targets = sharded_targets(labels, segments, d, cp, IGNORE_INDEX)
        return head_target_loss(hidden, model.lm_head, targets, num_targets, check=False)
    if segments is not None:
        aligned = document_labels(labels, segments, d, IGNORE_INDEX)
    else:
        aligned = labels if d == 0 else mtp_labels(labels, d, IGNORE_INDEX)
    return causal_lm_head_loss(hidden, model.lm_head, aligned, num_targets, check=False)


def add_causal_lm_losses(
    out: CausalLMOutput,
    model: Glm53LMHeadModel,
    labels: torch.Tensor,
    valid: torch.Tensor,
    stats: list[LayerStats],
    mtp_runs: list,
    den: LossCounts | None,
    segments: torch.Tensor | None = None,
    cp: SequenceShards | None = None,
    num_documents: int | None = None,
) -> None:
    """Fill out.lm_loss, .mtp_loss, .aux_loss, .indexer_loss and their weighted sum out.loss.

    `stats`: the decoder layers' LayerStats, `mtp_runs` the MTP depths' (hidden, valid_d, stats) (LMOutput).
    `segments` [B, T] (packed documents): no label crosses a document boundary, balance loss per document
    (`num_documents` bounds the ids: the document count from cu_seqlens' shape).
    `cp`: `labels` are next-token targets of this slice; each part is this rank's share, then `across_ranks`.
    """
    cfg = model.config
    out.lm_loss = loss = view_loss(model, out.last_hidden_state, labels, 0, den, segments, cp)
    if mtp_runs:
        per_depth = [view_loss(model, h, labels, d, den, segments, cp) for d, (h, _, _) in enumerate(mtp_runs, start=1)]
        out.mtp_loss = torch.stack(per_depth).mean()
        loss = loss + cfg.mtp_loss_weight * out.mtp_loss
    records = [(s, valid, 0) for s in stats] + [(s, v, d) for d, (_, v, s) in enumerate(mtp_runs, start=1)]
    out.aux_loss = router_aux_loss(
        records, cfg.router_aux_loss_coef, cfg.router_z_loss_coef, den, segments, cp, num_documents
    )
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    if cfg.indexer_loss_weight > 0:
        rows = lambda d: None if den is None else den.indexer_rows[d]  # noqa: E731
        terms = indexer_kl_terms(stats, valid, cfg.indexer_loss_mode, rows(0))
        for d, (_, v, s) in enumerate(mtp_runs, start=1):
            terms += indexer_kl_terms([s], v, cfg.indexer_loss_mode, rows(d))
        out.indexer_loss = torch.stack(terms).mean() if terms else out.lm_loss.new_zeros(())
        loss = loss + cfg.indexer_loss_weight * out.indexer_loss
    out.loss = loss
    if cp is not None:
        for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
            setattr(out, name, across_ranks(getattr(out, name), cp))


__all__ = ["CausalLMOutput", "Glm53ForCausalLM", "add_causal_lm_losses", "view_loss"]
