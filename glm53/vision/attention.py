"""Vision attention: fused qkv, per-head RMSNorm on q and k, 2-D axial rope, attention inside each segment.

Legend: N patch rows, D tower width, H heads, hd head width D / H.
As transformers' Glm5NextVisionAttention: qkv rows are q | k | v, each head-major; q_norm / k_norm (weight [hd])
run BEFORE the rope; the rope runs in fp32 and casts back; scale hd^-0.5; the softmax is fp32. Segments (an
image, or one temporal slice of a video) never attend to each other: kernels/vision_attention.py.
forward = output(attend(project(x))): `attend` reads the segment sizes on the host, `project` and `output` do not
(the vision block compiles the parts around `attend`, glm53/model/compile.py `compile_vision_blocks`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels import kernel_op
from ..model.norm import RMSNorm
from .config import Glm53VisionConfig
from .rotary import apply_rotary

segment_attention = kernel_op("segment_attention")  # resolved once; use_backend keeps it current


class VisionAttention(nn.Module):
    def __init__(self, config: Glm53VisionConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(D, 3 * D, bias=config.attention_bias)
        self.proj = nn.Linear(D, D, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.initializer_range = config.initializer_range

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        return self.output(self.attend(*self.project(x, rope), cu_seqlens))

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> q, k, v [N, H, hd]: the fused projection, the per-head norms, the rope (no host reads)."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, -1, self.head_dim).unbind(1)  # [N, H, hd] each
        cos, sin = rope
        return apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The attention inside each segment -> [N, H, hd] (reads cu_seqlens on the host)."""
        return segment_attention(q, k, v, cu_seqlens, self.scale)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [N, H, hd] -> [N, D]: the heads merged and projected."""
        return self.proj(o.reshape(o.shape[0], -1))

    def init_weights(self) -> None:
        for linear in (self.qkv, self.proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_norm.init_weights()
        self.k_norm.init_weights()
