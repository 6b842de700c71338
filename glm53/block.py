"""One decoder block: (KDA or MLA) then (dense MLP or MoE), each inside an mHC site.

Legend: B batch, T time, N streams, D model width.
    streams = attn_hc(streams, x -> attention(input_layernorm(x)))
    streams = ffn_hc(streams, x -> mlp(post_attention_layernorm(x)))
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import LINEAR_ATTENTION, Glm53Config
from .hyper_connection import HyperConnection
from .kda import KimiDeltaAttention
from .losses import LayerStats
from .mla import MultiHeadLatentAttention
from .mlp import MLP
from .moe import MoE
from .norm import RMSNorm


class DecoderBlock(nn.Module):
    def __init__(self, config: Glm53Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        self.self_attn = KimiDeltaAttention(config) if self.is_linear else MultiHeadLatentAttention(config, layer_idx)
        self.mlp = MoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        valid: torch.Tensor,
        shared_topk: torch.Tensor | None = None,
        stats: LayerStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [B, T, N, D], valid [B, T] bool -> (streams, this layer's top-k or None for KDA).

        `stats` (optional) is filled with what the training losses need (losses.LayerStats).
        """
        topk = None

        def attention(x: torch.Tensor) -> torch.Tensor:
            nonlocal topk
            x = self.input_layernorm(x)
            if self.is_linear:
                return self.self_attn(x, valid)
            out, topk = self.self_attn(x, valid, shared_topk, stats)
            return out

        def mlp(x: torch.Tensor) -> torch.Tensor:
            x = self.post_attention_layernorm(x)
            return self.mlp(x, stats) if isinstance(self.mlp, MoE) else self.mlp(x)

        streams = self.attn_hc(streams, attention)
        streams = self.ffn_hc(streams, mlp)
        return streams, topk

    def init_weights(self) -> None:
        for module in (self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm,
                       self.attn_hc, self.ffn_hc):  # fmt: skip
            module.init_weights()
