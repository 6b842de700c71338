"""Patch embedding: Conv3d(C, D, kernel = stride = (T, P, P)) on each pixel row viewed as [C, T, P, P].

Legend: N patch rows, C channels, T temporal patch, P patch side, D tower width.
The kernel covers the whole row, so the convolution is one linear map of the flattened row: the weight keeps
transformers' Conv3d shape [D, C, T, P, P] (its on-disk name `patch_embed.proj.weight`) and forward runs it as
`F.linear` on the [N, C*T*P*P] rows (no im2col). The input is cast to the weight's dtype, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hooks import as_local
from .config import Glm53VisionConfig


class PatchEmbed(nn.Module):
    def __init__(self, config: Glm53VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)
        self.initializer_range = config.initializer_range

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C*T*P*P] -> [N, D]
        weight = as_local(self.proj, "weight")
        return F.linear(pixels.to(weight.dtype), weight.flatten(1), as_local(self.proj, "bias"))

    def init_weights(self) -> None:
        nn.init.normal_(self.proj.weight, std=self.initializer_range)
        nn.init.zeros_(self.proj.bias)
