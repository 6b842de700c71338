"""The per-document balance loss under context parallelism, from sizes the shapes give (no host read).

Legend: B batch, T time (this rank's slice of every row), M tokens flattened (B * T), E routed experts, k experts per
token; s the number of context-parallel ranks (cp.size), d documents.
A document's balance term f . P needs three sums over its tokens: valid tokens, router probabilities [E] and routed
slots [E] (losses.py `balance_loss`). Under context parallelism a document may span several ranks' slices, but only
through a slice's edges: a slice of a row holds whole documents plus at most two pieces of documents that cross its
ends (its first and last document; one piece when the whole slice lies inside one document). So:
- each rank sums its tokens per local document into B * T slots (a slice of a row holds at most T documents: a size
  from the shapes, where the document count itself is data and reading it on the host would sync and break a
  compiled graph);
- the edge pieces [2B, 1 + 2E] and their global document ids (`segment_ids`, the same numbers on every rank) are
  stacked over the ranks, with gradient: [s, 2B, ...], small whatever the document count;
- every rank completes its edge documents' sums from the pieces with the same id, and counts a document only on the
  rank that holds its first token, so the ranks' shares sum to the whole loss and the stack's backward sends each
  piece its gradient.
"""

from __future__ import annotations

import torch

from ..model.context import SequenceShards


def owned_document_balance(
    logits: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, segment_ids: torch.Tensor, cp: SequenceShards
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sum of f . P over the documents starting in this slice, documents with a valid token on all ranks).

    logits [M, E] router logits, indices [M, k] chosen experts, valid [B, T] bool, segment_ids [B, T] int64 global
    document ids (non-decreasing along a row, +1 at each start: model/cp.py `sharded_packing_fields`).
    """
    B, T = valid.shape
    E, K = logits.shape[-1], indices.shape[-1]
    rows = torch.arange(B, device=logits.device)
    local = segment_ids - segment_ids[:, :1]  # [B, T] document number inside this slice's row, < T
    slot = (rows[:, None] * T + local).flatten()  # [M]
    scores = logits.float().sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)  # [M, E]
    m = valid.flatten().float()
    tokens_and_probs = torch.cat([m[:, None], probs * m[:, None]], dim=-1)  # [M, 1 + E]
    sums = torch.zeros(B * T, 1 + E, device=logits.device).index_add_(0, slot, tokens_and_probs)
    routed = (slot[:, None] * E + indices).flatten()
    counts = torch.zeros(B * T * E, device=logits.device).index_add_(0, routed, m.repeat_interleave(K)).view(-1, E)
    part = torch.cat([sums, counts], dim=-1)  # [B * T, 1 + 2E] per local document
    first, last = rows * T, rows * T + local[:, -1]  # [B] slots of each row's edge documents
    first_id, last_id = segment_ids[:, 0], segment_ids[:, -1]
    second = (first_id != last_id).float()[:, None]  # one piece when the slice lies inside one document
    edge_ids = cp.stack(torch.cat([first_id, last_id]))  # [s, 2B]
    pieces = cp.stack(torch.cat([part[first], part[last] * second]))  # [s, 2B, 1 + 2E]
    same = torch.cat([first_id, last_id])[:, None] == edge_ids.flatten()[None]  # [2B, s * 2B]
    whole = same.float() @ pieces.flatten(0, 1)  # [2B, 1 + 2E] the edge documents' sums over every rank
    part = part.index_copy(0, last, whole[B:]).index_copy(0, first, whole[:B])
    owned = torch.ones(B * T, dtype=torch.bool, device=logits.device)
    if cp.rank > 0:  # a row's first document started earlier when the previous slice ended inside it
        owned = owned.index_put((first,), edge_ids[cp.rank - 1, B:] != first_id)
    n, P, hits = part[:, 0], part[:, 1 : 1 + E], part[:, 1 + E :]
    f = hits * E / (K * n.clamp_min(1))[:, None]
    counted = (n > 0) & owned
    total = ((f * P / n.clamp_min(1)[:, None]).sum(-1) * counted).sum()
    return total, cp.sum(counted.sum().float())


__all__ = ["owned_document_balance"]
