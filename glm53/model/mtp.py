"""Multi-token prediction (MTP): predicts tokens t+2 .. t+1+depth from the main model's hidden states.

Legend: B batch, T time, D model width, vocab the vocabulary size.
One MTP layer (DeepSeek-V3 section 2.2, GLM-5), stored as `layers.{num_hidden_layers}.*` in the release:
    x  = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h_i^{d-1})])         [B, T, 2D] -> [B, T, D]
    x  = x + self_attn(input_layernorm(x))                            (NoPE MLA + its own DSA indexer, no mHC)
    h^d = x + mlp(post_attention_layernorm(x))                         (MoE)
    logits_d = lm_head(shared_head.norm(h^d))                          (embedding and lm_head are the model's)
The module returns shared_head.norm(h^d); the model applies its lm_head inside the loss (a chunked head + loss
that never holds the [B, T, vocab] logits of a depth).
h^0 is the main model's last hidden state (after the final norm, as serving stacks feed the released MTP layer).
Depth d (1-based) uses layer min(d, num_nextn_predict_layers) - 1, so GLM-5's single layer serves every depth.
Position i at depth d reads token i + d and predicts token i + d + 1; positions past the end read a zero
embedding and are masked out as padding (their labels are -100). Packed documents: a position whose token d
ahead lies in the next document is masked out the same way (it reads and predicts nothing across a boundary).
Context parallelism (ctx.cp): the tokens d ahead of a slice's last positions come from the next rank (model/cp.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Glm53Config
from .block import run_block
from .context import ForwardContext, LayerStats
from .cp import ahead
from .mla import MultiHeadLatentAttention
from .moe import MoE
from .norm import RMSNorm


class SharedHead(nn.Module):
    """The release's `shared_head`: only its norm is stored; the projection is the model's lm_head."""

    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        D = config.hidden_size
        self.initializer_range = config.initializer_range
        self.enorm = RMSNorm(D, config.rms_norm_eps)
        self.hnorm = RMSNorm(D, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.self_attn = MultiHeadLatentAttention(config, None)
        self.mlp = MoE(config)
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.shared_head = SharedHead(config)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """hidden h^{d-1} [B, T, D], embeds of the tokens d ahead [B, T, D] -> h^d [B, T, D].

        `ctx.valid` is this depth's validity; the layer always runs its own indexer (no shared top-k).
        """
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        attn, _ = self.self_attn(self.input_layernorm(x), ctx)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), ctx)

    def init_weights(self) -> None:
        nn.init.normal_(self.eh_proj.weight, std=self.initializer_range)
        for norm in (
            self.enorm,
            self.hnorm,
            self.input_layernorm,
            self.post_attention_layernorm,
            self.shared_head.norm,
        ):
            norm.init_weights()
        self.self_attn.init_weights()
        self.mlp.init_weights()


def shift_left(x: torch.Tensor, d: int, fill: float | bool = 0) -> torch.Tensor:
    """x [B, T, ...] -> x[:, d:] padded at the end with `fill` to length T (d may exceed T)."""
    tail = x[:, :0].new_full((x.shape[0], min(d, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, d:], tail], dim=1)


class MultiTokenPrediction(nn.Module):
    """`num_nextn_predict_layers` MTP layers run for `mtp_depth` depths (the model's `mtp` attribute)."""

    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        self.depth = config.mtp_depth
        self.layers = nn.ModuleList(MTPLayer(config) for _ in range(config.num_nextn_predict_layers))
        self.gradient_checkpointing = False

    def layer_for(self, d: int) -> MTPLayer:
        """The layer serving depth d (1-based)."""
        return self.layers[min(d, len(self.layers)) - 1]

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, ctx: ForwardContext
    ) -> list[tuple[torch.Tensor, torch.Tensor, LayerStats]]:
        """hidden [B, T, D] (main model, final-normed), embeds [B, T, D] of the input tokens; `ctx` is the main
        model's (its `valid` [B, T] and `record_indexer` are used; stats are always collected).

        -> per depth d = 1..mtp_depth: (shared_head.norm(h^d) [B, T, D], what lm_head reads to predict token
        i + d + 1; valid_d [B, T]; stats).
        """
        out = []
        h = hidden
        for d in range(1, self.depth + 1):
            layer = self.layer_for(d)
            valid_d = ctx.valid & ahead(ctx.valid, d, False, ctx.cp)
            if ctx.segment_ids is not None:
                valid_d = valid_d & (ahead(ctx.segment_ids, d, -1, ctx.cp) == ctx.segment_ids)
            depth_ctx = ForwardContext(
                valid=valid_d,
                collect_stats=True,
                record_indexer=ctx.record_indexer,
                cu_seqlens=ctx.cu_seqlens,
                segment_ids=ctx.segment_ids,
                cp=ctx.cp,
            )
            h, stats = run_block(self.gradient_checkpointing, layer, (h, ahead(embeds, d, 0.0, ctx.cp)), depth_ctx)
            out.append((layer.shared_head.norm(h), valid_d, stats))
        return out

    def init_weights(self) -> None:
        for layer in self.layers:
            layer.init_weights()


def mtp_labels(labels: torch.Tensor, d: int, ignore_index: int) -> torch.Tensor:
    """Labels for depth d, aligned like input_ids (causal_lm_loss shifts once more): labels[:, d:] + ignore."""
    return F.pad(labels[:, d:], (0, min(d, labels.shape[1])), value=ignore_index)
