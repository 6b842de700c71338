"""NoPE multi-head latent attention (MLA) with DSA top-k sparse attention.

Legend: B batch, T time (queries), S keys (the whole sequence under context parallelism), D model width, H heads,
R q_lora_rank, Z kv_lora_rank, K qk head width, V v head width, J selected key slots per query (einsum
subscripts: e, f, c stand for K, V, Z).
Following transformers' Glm5NextTextAttention (no rotary part: qk_rope_head_dim == 0):
    q_resid = RMSNorm(q_a_proj(x));            q = q_b_proj(q_resid)       [B, T, H, K]
    latent  = RMSNorm(kv_a_proj_with_mqa(x));  k, v = split(kv_b_proj(latent))   [B, T, H, K], [B, T, H, V]
    top-k   = this layer's indexer(x, q_resid)   or the indices shared from an earlier "full" layer
    out     = o_proj(sparse_attention(q, k, v, top-k, scale = K^-0.5))
The attention runs either per head (kernel "sparse_attention") or absorbed into the latent (kernel
"sparse_mqa_attention", see `absorb` below); both are exact rewrites of the same sum.
Packed documents (ctx.cu_seqlens): the indexer selects, and the attention kernels read, keys of the query's own
document only.
Context parallelism (ctx.cp): queries stay on their rank; the keys are the gathered latent of the whole sequence
(key_sequence.py) and the indexer pools at global positions, so every rank's rows equal one process's rows.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import Glm53Config
from ..hooks import as_local, into_head_parallel
from ..kernels import kernel_op
from .attention_mass import IndexerKlInputs, PoolMassInputs, attention_pool_mass
from .context import ForwardContext
from .indexer import Indexer
from .key_sequence import key_sequence, same_document_slots
from .norm import RMSNorm

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py)
sparse_attention, sparse_mqa_attention = kernel_op("sparse_attention"), kernel_op("sparse_mqa_attention")
# the steps after a cached prefill: the forms planned from shapes alone (kernels/sparse_static.py: no host read)
sparse_attention_static = kernel_op("sparse_attention", prefer="static")
sparse_mqa_attention_static = kernel_op("sparse_mqa_attention", prefer="static")


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
        # Absorbed form (DeepSeek-V2 "weight absorption"): attend in the kv_lora latent, shared by all heads, when
        # it is no wider than one head's key + value (GLM-5.3: 512 <= 256 + 256). Per (query, slot) it gathers Z
        # numbers instead of H * (K + V); per (query, head, slot) it costs 2Z instead of K + V flops. kv_b_proj must
        # have no bias (it has none). An explicit numerics setting: Glm53ForCausalLM.set_numerics(mla_absorb=...).
        self.absorb = config.kv_lora_rank <= self.qk_head_dim + self.v_head_dim
        # The indexer KL's record (ctx.stats.indexer): its O(T) inputs, the scores and pool mass recomputed per
        # query block by the loss (losses/indexer_kl.py), or the [B, T, P] scores, masks and pool mass themselves
        # (False). Exact either way; set_numerics.
        self.kl_recompute = True

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (out [B, T, D], top-k [B, T, J]); reads ctx.valid, ctx.shared_topk (shared layers).

        With `ctx.stats.indexer`, records what the indexer KL loss needs (losses/indexer_kl.py); the output is
        unchanged. With `ctx.cp` the queries are this rank's slice and the keys the whole sequence (see below).
        """
        if ctx.cache is not None and ctx.cp is not None:
            raise ValueError("a generation cache (ctx.cache) cannot be used with context parallelism (ctx.cp)")
        if ctx.cache is not None:  # generation: read and extend the cached latent and pools (model/cache.py)
            return self._cached(x, ctx)
        stats, cp = ctx.stats, ctx.cp
        keys = key_sequence(ctx)  # the whole sequence's mask and documents (gathered under cp)
        valid, cu_seqlens = keys.valid, keys.cu_seqlens
        record = stats is not None and stats.indexer
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (-1, self.qk_head_dim))  # [B, T, H, K]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))  # [B, T, Z]
        if cp is not None:  # every rank's latent: Z numbers per key (its gradient is summed back to the owner)
            latent = cp.all_gather(latent, dim=1)  # [B, S, Z]
        recompute = record and self.kl_recompute  # eager, compiled and under cp alike (losses/indexer_kl.py)
        topk = self._select(x, q_resid, ctx, keys, record, recompute)
        if cp is None:
            o, k = self._attend(q, latent, topk, {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens})
        else:  # the packed kernels take queries at the keys' own positions: drop other documents' slots here
            o, k = self._attend(q, latent, same_document_slots(topk, keys), {})
        if recompute:  # the mass's inputs only: the loss recomputes it per query block (losses/indexer_kl.py)
            with torch.no_grad():
                k = self._expand_kv(latent)[0] if k is None else k.detach()
            stats.mass_inputs = PoolMassInputs(
                q.detach(), k, valid, cu_seqlens, self.kpool, self.scale, offset=keys.offset
            )
        elif record:
            k = self._expand_kv(latent)[0] if k is None else k
            stats.pool_mass = attention_pool_mass(
                q, k, valid, self.kpool, self.scale, cu_seqlens=cu_seqlens, query_offset=keys.offset
            )
        if self.training and self.dropout > 0:
            o = nn.functional.dropout(o, self.dropout)
        return self.o_proj(o.flatten(-2)), topk  # o [B, T, H, V] -> [B, T, H*V]

    def _select(
        self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext, keys, record: bool, recompute: bool
    ) -> torch.Tensor:
        """This layer's top-k [B, T, J] (its indexer's, or the shared one), recording the indexer KL's inputs
        (`recompute`) or its [B, T, P] scores and masks (`record`) into ctx.stats for a full indexer."""
        stats, cp, valid, cu_seqlens = ctx.stats, ctx.cp, keys.valid, keys.cu_seqlens
        if self.indexer is not None and recompute:
            topk = self.indexer(x, q_resid, valid, cu_seqlens, shards=cp)  # blocked: no [B, T, P]
            inputs = self.indexer.kl_inputs(x, q_resid, valid, cu_seqlens, shards=cp)
            stats.indexer_inputs = IndexerKlInputs(
                **inputs,
                topk=topk,
                valid=valid,
                cu_seqlens=cu_seqlens,
                kpool=self.kpool,
                scale=self.indexer.head_dim**-0.5,
                offset=keys.offset,
            )
            return topk
        if self.indexer is not None and record:
            topk, stats.index_scores, stats.candidate, stats.selected = self.indexer.score_and_select(
                x, q_resid, valid, grad=True, cu_seqlens=cu_seqlens, shards=cp
            )
            return topk
        if self.indexer is not None:
            return self.indexer(x, q_resid, valid, cu_seqlens, shards=cp)
        if ctx.shared_topk is None:
            raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
        return ctx.shared_topk

    def _cached(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward on a generation cache: this forward's latent rows are written at the cache's next positions,
        the indexer extends and scores the cached pools, and the queries attend over the cached rows (the prefill
        over its own fresh rows) -> (out [B, T, D], top-k [B, T, J] positions on the cache's time axis)."""
        generation = ctx.cache
        cache = generation.layer(self)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (-1, self.qk_head_dim))  # [B, T, H, K]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))  # [B, T, Z]
        cache.write(generation.new_positions(x.shape[1]), latent)
        if self.indexer is not None:
            topk = self.indexer.cached_select(x, q_resid, generation, cache)
        elif ctx.shared_topk is None:
            raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
        else:
            topk = ctx.shared_topk
        keys = latent if not generation.started else cache.keys(latent.dtype)  # the prefill's rows are its own
        o, _ = self._attend(q, keys, topk, {}, static=generation.started)
        return self.o_proj(o.flatten(-2)), topk  # o [B, T, H, V] -> [B, T, H*V]

    def _attend(
        self, q: torch.Tensor, latent: torch.Tensor, topk: torch.Tensor, packed: dict, static: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, T, H, K], latent [B, S, Z], topk [B, T, J] -> (o [B, T, H, V], the per-head keys [B, S, H, K]
        when they were expanded, else None). `packed`: the kernels' cu_seqlens keyword, when packed. `static`: the
        kernels planned from shapes alone (a step on a prefilled cache: S is its fixed length)."""
        if not self.absorb:
            k, v = self._expand_kv(latent)
            attend = sparse_attention_static if static else sparse_attention
            return attend(q, k, v, topk, self.scale, **packed), k
        # q_abs = W_uk^T q per head; attend in the latent (key = value = latent); o = W_uv o_latent
        w = as_local(self.kv_b_proj, "weight").view(-1, self.qk_head_dim + self.v_head_dim, latent.shape[-1])
        w_uk, w_uv = w.split([self.qk_head_dim, self.v_head_dim], dim=1)  # [H, K, Z], [H, V, Z]
        q_abs = torch.einsum("bthe,hec->bthc", q, w_uk)
        # under TP this rank's heads read the whole latent: its gradient is summed over the ranks
        shared = into_head_parallel(self.kv_b_proj, "weight", latent)
        attend = sparse_mqa_attention_static if static else sparse_mqa_attention
        o_latent = attend(q_abs, shared, topk, self.scale, **packed)  # [B, T, H, Z]
        return torch.einsum("bthc,hfc->bthf", o_latent, w_uv), None

    def _expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, T, Z] -> per-head k [B, T, H, K], v [B, T, H, V]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (-1, self.qk_head_dim + self.v_head_dim))  # [B, T, H, K + V]
        k, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        return k, v

    def init_weights(self) -> None:
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            nn.init.normal_(linear.weight, std=self.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()
