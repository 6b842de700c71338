"""Normalisations. Legend: ... any leading dims, D normalised width.

All statistics are computed in fp32 (MODEL_NOTES.md, "Numerics"). The one RMS formula lives in `rms_normalize`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .boundary import as_local


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Weighted RMSNorm as transformers' Glm5NextTextRMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return as_local(self, "weight") * rms_normalize(x, self.eps).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """KDA's output norm: RMSNorm(x) * weight * sigmoid(gate), all in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D], [..., D]
        y = rms_normalize(x, self.eps) * as_local(self, "weight").float() * torch.sigmoid(gate.float())
        return y.to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the indexer's key norm), parameters read through the kernel boundary.

    Same parameters and numerics as `nn.LayerNorm(dim, eps)`; reading them through `as_local` lets it run with
    DTensor parameters under tensor parallelism like every other glm53 norm.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return F.layer_norm(x, (x.shape[-1],), as_local(self, "weight"), as_local(self, "bias"), self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
