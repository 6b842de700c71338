"""One decoder block: (KDA or MLA) then (dense MLP or MoE), each inside an mHC site.

Legend (glm53/model/__init__.py): B batch, T time, N streams, D model width, J selected key slots per query.
    x, mix  = attn_hc.enter(streams)                   x = sum_j pre_j streams_j       [B, T, D]
    streams = attn_hc.exit(streams, attention(input_layernorm(x)), mix)
    x, mix  = ffn_hc.enter(streams)
    streams = ffn_hc.exit(streams, mlp(post_attention_layernorm(x)), mix)
(transformers' Glm5NextTextDecoderLayer; hyper_connection.py holds the two halves of a site.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config import LINEAR_ATTENTION, Glm53Config
from .context import ForwardContext, LayerStats
from .hyper_connection import HyperConnection
from .kda import KimiDeltaAttention
from .mla import MultiHeadLatentAttention
from .mlp import MLP
from .moe import MoE
from .norm import RMSNorm


class DecoderBlock(nn.Module):
    def __init__(self, config: Glm53Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.self_attn = KimiDeltaAttention(config) if self.is_linear else MultiHeadLatentAttention(config, layer_idx)
        self.mlp = MoE(config) if self.is_moe else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [B, T, N, D] -> (streams, this layer's top-k [B, T, J], or None for a KDA layer).

        `ctx.stats` (when set) is filled with what the training losses need.
        """
        x, mix = self.attn_hc.enter(streams)
        x = self.input_layernorm(x)
        if self.is_linear:
            attended, topk = self.self_attn(x, ctx), None
        else:
            attended, topk = self.self_attn(x, ctx)
        streams = self.attn_hc.exit(streams, attended, mix)

        x, mix = self.ffn_hc.enter(streams)
        x = self.post_attention_layernorm(x)
        mixed = self.mlp(x, ctx) if self.is_moe else self.mlp(x)
        return self.ffn_hc.exit(streams, mixed, mix), topk

    def init_weights(self) -> None:
        for module in (
            self.self_attn,
            self.mlp,
            self.input_layernorm,
            self.post_attention_layernorm,
            self.attn_hc,
            self.ffn_hc,
        ):
            module.init_weights()


def run_block(recompute: bool, block: Callable, inputs: tuple, ctx: ForwardContext) -> tuple[object, LayerStats | None]:
    """block(*inputs, layer_ctx) -> (output, the layer's stats), recomputed in backward when `recompute`.

    The layer's stats sink is made inside the recomputed region, so recomputation fills a throw-away copy:
    nothing the caller reads (expert loads included) is recorded twice. `ctx` must not be mutated afterwards
    (callers rebind it with dataclasses.replace), since recomputation reads it again.
    """
    if recompute and torch.is_grad_enabled():
        return checkpoint(_call_with_layer_context, block, ctx, *inputs, use_reentrant=False)
    return _call_with_layer_context(block, ctx, *inputs)


def _call_with_layer_context(block: Callable, ctx: ForwardContext, *inputs) -> tuple[object, LayerStats | None]:
    layer_ctx = ctx.for_layer()
    return block(*inputs, layer_ctx), layer_ctx.stats
