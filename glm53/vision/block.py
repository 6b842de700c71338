"""Vision block (pre-norm, residual): x += proj(attn(norm1(x))); x += mlp(norm2(x)).

Legend: N patch rows, D tower width, I the MLP's inner width (intermediate_size).
The MLP is the clamped SwiGLU with biases (attention_bias): down(silu(min(gate, L)) * clamp(up, -L, L)).
forward = attention_residual_and_mlp(x, attn.attend(attention_inputs(x))): the two outer parts are the elementwise
work (norms, rope, SwiGLU, residuals) a compiled tower fuses; the attention between them reads host sizes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.moe import clamped_swiglu
from ..model.norm import RMSNorm
from .attention import VisionAttention
from .config import Glm53VisionConfig


class SwiGLU(nn.Module):
    """Clamped SwiGLU [..., d_in] -> [..., d_in] through an inner width; biases optional."""

    def __init__(self, width: int, inner: int, bias: bool, limit: float, std: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=bias)
        self.up_proj = nn.Linear(width, inner, bias=bias)
        self.down_proj = nn.Linear(inner, width, bias=bias)
        self.swiglu_limit = limit
        self.initializer_range = std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))

    def init_weights(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)


class VisionBlock(nn.Module):
    # the methods around the segment attention, which read no host sizes: what compile_vision_blocks compiles
    COMPILED_PARTS = ("attention_inputs", "attention_residual_and_mlp")

    def __init__(self, config: Glm53VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = SwiGLU(
            config.hidden_size,
            config.intermediate_size,
            config.attention_bias,
            config.swiglu_limit,
            config.initializer_range,
        )

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, rope)
        return self.attention_residual_and_mlp(x, self.attn.attend(q, k, v, cu_seqlens))

    def attention_inputs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> q, k, v [N, H, hd]: norm1, qkv, q/k norms, rope."""
        return self.attn.project(self.norm1(x), rope)

    def attention_residual_and_mlp(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x [N, D], attention output o [N, H, hd] -> x + proj(o), then + mlp(norm2(.)) [N, D]."""
        x = x + self.attn.output(o)
        return x + self.mlp(self.norm2(x))

    def init_weights(self) -> None:
        self.norm1.init_weights()
        self.norm2.init_weights()
        self.attn.init_weights()
        self.mlp.init_weights()
