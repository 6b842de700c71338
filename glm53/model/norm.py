"""Normalisations. Legend: ... any leading dims, d the normalised width (D in the block norms, R and Z in MLA's
latent norms, K in the indexer's key LayerNorm, V in KDA's gated output norm).

All statistics are computed in fp32 (docs/model.md, "Numerics"). The RMS formulas live in kernels/rms_norm.py
(a reference and a fast form with a hand-written backward).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hooks import as_local
from ..kernels import kernel_op

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py)
rms_norm, gated_rms_norm = kernel_op("rms_norm"), kernel_op("gated_rms_norm")


class RMSNorm(nn.Module):
    """Weighted RMSNorm as transformers' Glm5NextTextRMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d]
        return rms_norm(x, as_local(self, "weight"), self.eps)

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

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., d], [..., d]
        return gated_rms_norm(x, gate, as_local(self, "weight"), self.eps)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d]
        return F.layer_norm(x, (x.shape[-1],), as_local(self, "weight"), as_local(self, "bias"), self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
