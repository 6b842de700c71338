"""Sinkhorn-Knopp normalisation of mHC's comb matrix towards a doubly-stochastic matrix.

Legend: N streams. x: [..., N, N] positive. Following transformers' Glm5NextTextHyperConnection: first divide
by column sums, then (iters - 1) rounds of (rows, columns), each sum floored by `eps`. Computed in fp32.
"""

from __future__ import annotations

import torch

from .dispatch import register


def sinkhorn_reference(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    x = x.float()
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


register("sinkhorn", "reference", sinkhorn_reference)
