"""DSA indexer scores against pooled keys: score(t, p) = sum_h w_h(t) * relu(q_h(t) . key_p * scale).

Legend: B batch, T queries, H indexer heads, K head width, P pools, Tq a block of queries.
q: [B, T, H, K]; weights: [B, T, H] (already scaled by H^-0.5); pool_keys: [B, P, K]. Returns [B, T, P] fp32.
The ReLU sits between the head contraction and the head sum, so the [T, H, P] logits cannot be factorised away;
the fast form only bounds how many of them exist at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register

SCORE_BUDGET = 1 << 22  # elements of one [B, Tq, H, P] logits chunk (16 MiB in fp32)


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """All queries at once: materialises the [B, T, H, P] logits."""
    logits = torch.matmul(q.float(), pool_keys.float().transpose(-1, -2)[:, None])  # [B, T, H, P]
    logits = F.relu(logits * scale)
    return torch.matmul(weights.float()[..., None, :], logits).squeeze(-2)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The same, one chunk of queries at a time: never more than SCORE_BUDGET logits alive; same signature."""
    B, T, H, _ = q.shape
    P = pool_keys.shape[1]
    step = max(1, SCORE_BUDGET // max(1, B * H * P))
    if step >= T:
        return indexer_scores_reference(q, weights, pool_keys, scale)
    keys_t = pool_keys.float().transpose(-1, -2)[:, None]  # [B, 1, K, P]
    out = q.new_empty(B, T, P, dtype=torch.float32)
    for start in range(0, T, step):
        end = min(start + step, T)
        logits = F.relu(torch.matmul(q[:, start:end].float(), keys_t) * scale)  # [B, Tq, H, P]
        out[:, start:end] = torch.matmul(weights[:, start:end].float()[..., None, :], logits).squeeze(-2)
    return out


register("indexer_scores", "reference", indexer_scores_reference)
register("indexer_scores", "fast", indexer_scores)
