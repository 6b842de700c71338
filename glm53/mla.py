"""NoPE multi-head latent attention (MLA) with DSA top-k sparse attention.

Legend: B batch, T time, D model width, H heads, R q_lora_rank, C kv_lora_rank, E qk head width, F v head width,
J selected key slots per query.
Following transformers' Glm5NextTextAttention (no rotary part: qk_rope_head_dim == 0):
    q_resid = RMSNorm(q_a_proj(x));            q = q_b_proj(q_resid)       [B, T, H, E]
    latent  = RMSNorm(kv_a_proj_with_mqa(x));  k, v = split(kv_b_proj(latent))   [B, T, H, E], [B, T, H, F]
    top-k   = this layer's indexer(x, q_resid)   or the indices shared from an earlier "full" layer
    out     = o_proj(sparse_attention(q, k, v, top-k, scale = E^-0.5))
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .config import Glm53Config
from .indexer import Indexer
from .kernels import kernel
from .losses import LayerStats, attention_pool_mass
from .norm import RMSNorm


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: Glm53Config, layer_idx: int | None) -> None:
        """layer_idx None: a layer outside the decoder stack (the MTP block), always with its own indexer."""
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.scale = self.qk_head_dim**-0.5
        self.dropout = config.attention_dropout
        self.initializer_range = config.initializer_range
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.qk_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, D, bias=bias)
        # "shared" layers have no indexer: they reuse the most recent full layer's selection.
        self.shares_topk = layer_idx is not None and config.indexer_types[layer_idx] == "shared"
        self.kpool = config.index_kpool
        self.indexer = None if self.shares_topk else Indexer(config)

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor,
        shared_topk: torch.Tensor | None = None,
        stats: LayerStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D], valid [B, T] bool, shared_topk [B, T, J] for shared layers -> (out [B, T, D], top-k).

        With `stats.indexer`, records what the indexer KL loss needs (losses.py); the output is unchanged.
        """
        record = stats is not None and stats.indexer
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = rearrange(self.q_b_proj(q_resid), "b t (h e) -> b t h e", e=self.qk_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        kv = rearrange(self.kv_b_proj(latent), "b t (h e) -> b t h e", e=self.qk_head_dim + self.v_head_dim)
        k, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        if self.indexer is not None and record:
            topk, stats.index_scores, stats.candidate, stats.selected = self.indexer.score_and_select(
                x, q_resid, valid, grad=True
            )
        elif self.indexer is not None:
            topk = self.indexer(x, q_resid, valid)
        elif shared_topk is None:
            raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
        else:
            topk = shared_topk
        o = kernel("sparse_attention")(q, k, v, topk, self.scale)
        if record:
            stats.pool_mass = attention_pool_mass(q, k, valid, self.kpool, self.scale)
        if self.training and self.dropout > 0:
            o = nn.functional.dropout(o, self.dropout)
        return self.o_proj(rearrange(o, "b t h f -> b t (h f)")), topk

    def init_weights(self) -> None:
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()
