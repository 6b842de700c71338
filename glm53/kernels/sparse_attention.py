"""Top-k sparse attention: each query attends only to the key positions the DSA indexer selected.

Legend: B batch, T queries, S keys, H heads, D q/k width, E value width, J selected slots per query.
q: [B, T, H, D]; k: [B, S, H, D]; v: [B, S, H, E]; topk_indices: [B, T, J] integer key positions, -1 marks an
empty slot (a position appears at most once per row: the indexer selects disjoint pools and a disjoint tail).
Returns o [B, T, H, E] in q's dtype; softmax in fp32. A query whose slots are all empty (a padding row)
gets a zero output. (transformers' eager path gives such rows a uniform average over all keys instead;
they are padding, nothing downstream reads them.)
"""

from __future__ import annotations

import torch

from .dispatch import register


def topk_to_mask(topk_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, T, J] indices (-1 empty) -> [B, T, S] bool mask of selected keys."""
    valid = (topk_indices >= 0) & (topk_indices < num_keys)
    safe = topk_indices.long().clamp(0, num_keys - 1)
    counts = torch.zeros(*topk_indices.shape[:2], num_keys, dtype=torch.int32, device=topk_indices.device)
    counts.scatter_add_(-1, safe, valid.to(torch.int32))
    return counts > 0


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense scores over all S keys, masked to the selected set: O(T * S), the obviously-correct form."""
    mask = topk_to_mask(topk_indices, k.shape[1])  # [B, T, S]
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-empty rows -> 0
    return torch.einsum("bhts,bshe->bthe", probs, v.float()).to(q.dtype)


register("sparse_attention", "reference", sparse_attention_reference)
