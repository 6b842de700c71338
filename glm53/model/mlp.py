"""The clamped SwiGLU MLP (dense layers and the MoE's shared expert). Legend: D model width, I inner width."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import Glm53Config
from ..kernels.moe import clamped_swiglu


class MLP(nn.Module):
    def __init__(self, config: Glm53Config, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.swiglu_limit = config.swiglu_limit
        self.initializer_range = config.initializer_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))

    def init_weights(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
