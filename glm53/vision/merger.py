"""After the blocks: downsample (m x m patches -> one row) and the merger (the projector into the text width).

Legend: N patch rows, G = N / m^2 merged rows, m merge size, D tower width, O out width, J the merger's inner
width (projection_intermediate_size).
`downsample` is Conv2d(D, O, kernel = stride = m) on each group of m * m consecutive rows (row i * m + j at kernel
position [i, j]); the kernel covers the group, so forward runs it as one linear map of the [G, m*m*D] group
(weight permuted to (i, j, d) order). The merger: Linear(O, O, no bias) -> LayerNorm(O) (eps 1e-5, affine) ->
exact GELU -> clamped SwiGLU without biases (O -> J -> O).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hooks import as_local
from ..model.norm import LayerNorm
from .block import SwiGLU
from .config import Glm53VisionConfig

MERGER_NORM_EPS = 1e-5  # transformers' nn.LayerNorm default (the config has no field for it)


class Downsample(nn.Conv2d):
    """Holds the Conv2d weight [O, D, m, m] under its on-disk name; forward is the equivalent linear map."""

    def __init__(self, config: Glm53VisionConfig) -> None:
        m = config.spatial_merge_size
        super().__init__(config.hidden_size, config.out_hidden_size, kernel_size=m, stride=m)
        self.merge = m
        self.initializer_range = config.initializer_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [G, O]
        weight = as_local(self, "weight")  # [O, D, m, m]
        groups = x.reshape(-1, self.merge * self.merge * x.shape[-1])  # [G, m*m*D] in (i, j, d) order
        return F.linear(groups, weight.permute(0, 2, 3, 1).flatten(1), as_local(self, "bias"))

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=self.initializer_range)
        nn.init.zeros_(self.bias)


class PatchMerger(SwiGLU):
    """The projector's SwiGLU with its input projection and norm in front (on disk: merger.{proj,
    post_projection_norm, gate_proj, up_proj, down_proj})."""

    def __init__(self, config: Glm53VisionConfig) -> None:
        out = config.out_hidden_size  # O
        super().__init__(out, config.projection_intermediate_size, False, config.swiglu_limit, config.initializer_range)
        self.proj = nn.Linear(out, out, bias=False)
        self.post_projection_norm = LayerNorm(out, MERGER_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [G, O] -> [G, O]
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))

    def init_weights(self) -> None:
        super().init_weights()
        nn.init.normal_(self.proj.weight, std=self.initializer_range)
        self.post_projection_norm.init_weights()
