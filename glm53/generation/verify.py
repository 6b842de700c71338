"""The verify step: T new tokens per row (ids [B, T]) through the whole model in one pass, reading and extending a
prefilled GenerationCache. Speculative decoding runs it on [t_n, d_{n+1} .. d_{n+s}] (T = s + 1).

Legend (glm53/model/__init__.py): B batch, T new tokens per row, R = B*T rows, N mHC streams, D model width,
H heads (of MLA, KDA or the indexer), K query/key head width, V value head width, Z kv_lora_rank, W conv width,
L tokens per k-pool, P k-pools, J selected key slots.
It computes what `Glm53Model.forward(ids, cache=cache)` computes (the generic cached path), in decode.py's form:
- everything outside attention is per token, so the T tokens of every row are R independent rows through decode.py's
  mHC, norm and MoE helpers (as many ops as one decode step; only the arithmetic and the expert weights read grow);
- KDA runs its recurrent form for the T tokens, keeping the state after each one (out of place) so a marked cache
  can rewind to any of them (KdaLayerCache.record); the T short-conv outputs are one unfolded product;
- MLA appends the T latents, then each query reads its own selected rows (as layers._cached_attention): causality
  among the T new tokens lives in the top-k, which never names a position after its query;
- the indexer pushes the T tokens' keys one by one (a k-pool can complete mid-verify: it is a candidate only for
  the queries at or after its last token, as in the full forward) and records them for a rewind; the candidate
  masks and the tail of each query's incomplete pool come from the per-row token counts kept on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundary import as_local
from ..kernels import kernel
from .cache import CacheError, GenerationCache, KdaLayerCache, MlaLayerCache, check_step_inputs
from .decode_common import _absorbed_attention
from .decode import (KDA_RECURRENT_DTYPE, _as, _Block, _coefficients, _collapse, _Indexer, _Kda, _Mla, _mla, _Moe,
                     _moe, _moe_step, _mix, _push_pool_token, _rms, _site, build_plan)  # fmt: skip
from .layers import L2NORM_EPS, _cached_attention, _gather_rows


# ------------------------------------------------------------------------------------------------------------ KDA
def kda_tokens(p: _Kda, x: torch.Tensor, cache: KdaLayerCache) -> torch.Tensor:
    """KimiDeltaAttention on T tokens: x [B, T, D] -> [B, T, D]; the cache advances by T (recorded when marked)."""
    B, T, _ = x.shape
    K = p.head_dim
    q_raw, k_raw, v_raw, f_a, b, g_a = (F.linear(x, w, bias) for w, bias in p.proj)
    raw = torch.cat([q_raw, k_raw, v_raw], dim=-1)  # [B, T, 3*H*K]
    full = torch.cat([cache.conv, raw], dim=1)  # [B, W-1+T, 3*H*K]
    W = p.taps.shape[0]
    windows = _as(full, torch.float32).unfold(1, W, 1)  # [B, T, 3*H*K, W]: the W inputs each output reads
    conv = (windows * p.taps.t()).sum(-1)
    qkv = _as(F.silu(conv), x.dtype).view(B, T, 3, -1, 1, K)  # [B, T, 3, H, 1, K]
    qk = _as(qkv[:, :, :2], torch.float32)
    qk = qk / torch.sqrt((qk * qk).sum(dim=-1, keepdim=True) + L2NORM_EPS)  # l2norm
    graw = (_as(F.linear(f_a, p.f_b), torch.float32) + p.dt_bias).view(B, T, -1, K, 1)  # [B, T, H, K, 1]
    if p.lower_bound is not None:
        g = p.lower_bound * torch.sigmoid(p.rate * graw)
    else:
        g = -p.rate * F.softplus(graw, threshold=20.0)
    dt = KDA_RECURRENT_DTYPE if x.dtype != torch.float64 else torch.float64
    q, k, v = _as(qk[:, :, 0], dt) * K**-0.5, _as(qk[:, :, 1], dt), _as(qkv[:, :, 2], dt)  # [B, T, H, 1, K]
    beta = _as(torch.sigmoid(b), dt).view(B, T, -1, 1, 1)
    S, states, outs = cache.state, [], []
    steps = zip(q.unbind(1), k.unbind(1), k.transpose(-1, -2).unbind(1), v.unbind(1), beta.unbind(1),
                _as(g, dt).exp().unbind(1))  # fmt: skip
    for q_t, k_t, kT_t, v_t, beta_t, decay_t in steps:  # a new state per token: each stays valid for a rewind
        S = S * decay_t
        u = (v_t - torch.matmul(k_t, S)).mul_(beta_t)  # [B, H, 1, V]
        S.addcmul_(kT_t, u)
        outs.append(torch.matmul(q_t, S))
        states.append(S)
    o = _as(torch.stack(outs, dim=1), qkv.dtype)  # [B, T, H, 1, V]
    if cache.marked:
        cache.record(states, raw)
    cache.state, cache.conv = S, full[:, T:]
    cache.length += T
    gate = _as(F.linear(g_a, p.g_b), torch.float32).view(B, T, -1, 1, K)
    of = F.rms_norm(_as(o, torch.float32), (K,), None, p.norm_eps) * p.norm_weight * torch.sigmoid(gate)
    return F.linear(_as(of, o.dtype).view(B, T, -1), *p.o)


# ------------------------------------------------------------------------------------------------------------ MLA
def _push_tokens(p: _Indexer, cache: MlaLayerCache, keys: torch.Tensor, gate: torch.Tensor) -> None:
    """Push the T tokens' indexer keys [B, T, K] and gate logits [B, T, K] into the pools, one token at a time;
    recorded for a rewind when the cache is marked. The host counts are left as they were."""
    counts, max_count = cache.counts_host, cache.max_count
    ones = torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
    for t in range(keys.shape[1]):
        if cache.marked:
            cache._pending.append((keys[:, t], gate[:, t], ones))
        _push_pool_token(p, cache, keys[:, t], gate[:, t])
        cache.counts_host = [c + 1 for c in cache.counts_host]
        cache.max_count += 1
    cache.counts_host, cache.max_count = counts, max_count


def _tail(seen: list[list[int]], start: int, L: int, device) -> torch.Tensor:
    """Each query's visible tokens of its incomplete pool (Indexer.visible_tail): seen[b][t] tokens of row b up to
    query t (at position start + t) -> [B, T, L-1], -1 where empty."""
    rows = [[[start + t - (c % L) + 1 + o if o < c % L else -1 for o in range(L - 1)] for t, c in enumerate(row)]
            for row in seen]  # fmt: skip
    return torch.tensor(rows, dtype=torch.long, device=device)


def verify_topk(p: _Indexer, cache: MlaLayerCache, x: torch.Tensor, q_resid: torch.Tensor, start: int,
                x_proj: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """The indexer's selection for the last Q of the T new tokens (at positions start .. start+T-1) -> [B, Q, J];
    x [B, T, D] (every token's key joins the pools), q_resid [B, Q, R] (the queries'). x_proj: x's wk, gate and
    weights_proj products [B, T, *] when already made (the compiled step's packed projection). The host counts
    still exclude the T tokens afterwards."""
    B, T, _ = x.shape
    Q, L = q_resid.shape[1], p.L
    if x_proj is None:
        x_proj = (F.linear(x, p.wk), F.linear(x, p.gate), F.linear(x[:, T - Q :], p.weights_proj))
    keys = F.layer_norm(x_proj[0], (p.head_dim,), *p.k_norm)  # [B, T, K]
    _push_tokens(p, cache, keys, x_proj[1].float())
    seen = [[c + t + 1 for t in range(T - Q, T)] for c in cache.counts_host]  # [B][Q] tokens up to each query
    P = (cache.max_count + T) // L  # pools some row has completed by the last query
    q = F.linear(q_resid, p.wq_b).view(B, Q, p.n_heads, p.head_dim)
    w = x_proj[2][:, -Q:].float() * p.n_heads**-0.5  # [B, Q, H]
    pooled = cache.pools.keys[:, None, :P].float().transpose(-1, -2)  # [B, 1, K, P]
    logits = F.relu(torch.matmul(q.float(), pooled) * p.head_dim**-0.5)  # [B, Q, H, P]
    scores = torch.matmul(w[..., None, :], logits)[..., 0, :]  # [B, Q, P] fp32
    uniform = all(row[0] // L == P for row in seen)  # every query sees all P pools
    if not uniform:  # a pool is a candidate for the queries at or after its last token
        complete = torch.tensor([[n // L for n in row] for row in seen], device=x.device)  # [B, Q]
        candidate = torch.arange(P, device=x.device) < complete[..., None]  # [B, Q, P]
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
    chosen = scores.topk(min(p.select, P), dim=-1).indices  # [B, Q, select]
    tokens = chosen[..., None] * L + p.token_offsets[:, None]  # [B, Q, select, L]
    if not uniform:
        tokens = tokens.masked_fill(~candidate.gather(-1, chosen)[..., None], -1)
    parts = [tokens.flatten(2)]
    if p.tail:
        parts.append(_tail(seen, start + T - Q, L, x.device))
    topk = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if topk.shape[-1] < p.num_slots:
        topk = F.pad(topk, (0, p.num_slots - topk.shape[-1]), value=-1)
    return topk


def mla_tokens(p: _Mla, x: torch.Tensor, cache: MlaLayerCache, shared: torch.Tensor | None,
               queries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """MultiHeadLatentAttention on T tokens: x [B, T, D] -> (out [B, Q, D], top-k [B, Q, J]) for the last Q =
    `queries` (default T) of them; all T join the cache (a draft needs only its last position's output)."""
    B, T, _ = x.shape
    Q = T if queries is None else queries
    q_resid = _rms(F.linear(x[:, T - Q :], *p.q_a), *p.q_a_norm)  # [B, Q, R]
    q = F.linear(q_resid, p.q_b).view(B, Q, -1, p.qk_head_dim)  # [B, Q, H, K]
    latent = _rms(F.linear(x, *p.kv_a), *p.kv_norm)  # [B, T, Z]
    topk = cache_tokens(p, cache, latent, x, q_resid, shared)
    o = _attention(p, q, cache, topk) if p.absorb else _cached_attention(p.module, q, cache, topk)  # [B, Q, H, V]
    return F.linear(o.reshape(B, Q, -1), *p.o), topk


def cache_tokens(p: _Mla, cache: MlaLayerCache, latent: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                 shared: torch.Tensor | None, x_proj: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """The MLA cache's bookkeeping for T tokens (decode._cache_token's): append their latents [B, T, Z], pick the
    top-k [B, Q, J] of the last Q (q_resid [B, Q, R]; its own indexer or the shared one), advance the lengths and
    counts -> top-k."""
    T = latent.shape[1]
    start = cache.length
    if cache.latent.shape[1] < start + T:
        cache.ensure(start + T)
    cache.write(start, latent)
    if p.indexer is not None:
        topk = verify_topk(p.indexer, cache, x, q_resid, start, x_proj)
    elif shared is None:
        raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
    else:
        topk = shared
    cache.length = start + T
    cache.count = cache.count + T
    cache.max_count += T
    cache.counts_host = [c + T for c in cache.counts_host]
    return topk


def _attention(p: _Mla, q: torch.Tensor, cache: MlaLayerCache, topk: torch.Tensor) -> torch.Tensor:
    """layers._cached_attention's absorbed form for Q queries per row, as decode.py's batched products over the
    B*Q queries: q [B, Q, H, K], topk [B, Q, J] -> [B, Q, H, V]."""
    B, Q, H, _ = q.shape
    kv, filled = _gather_rows(cache, topk)  # [B, Q, J, Z], [B, Q, J]
    o = _absorbed_attention(p, q.reshape(B * Q, H, -1), kv.view(B * Q, -1, kv.shape[-1]), filled.view(B * Q, -1))
    return o.reshape(B, Q, H, -1)


# ------------------------------------------------------------------------------------------------------------ MoE
def _moe_rows(p: _Moe, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward for R rows x [R, D]: decode.py's GEMV pairs for one row; for more, the experts kernel the
    layer's own forward runs (rows share experts, and its one grouped product beats a GEMV pair per expert)."""
    if x.shape[0] == 1:
        return _moe_step(p, x)
    _, weights, indices = p.router(x)  # [R, k] fp32, [R, k]
    return kernel("moe_experts")(x, indices, weights, p.gate_up, p.down, p.limit) + p.shared(x)


# ---------------------------------------------------------------------------------------------------- block loop
@dataclass
class VerifyPlan:
    """The mHC sites sized for R = B*T rows, per T (the rest is the decode plan's)."""

    sites: dict  # T -> [(attn_site, ffn_site) per block]


def _sites(model: nn.Module, cache: GenerationCache, rows: int) -> list:
    plan = cache.verify_plan
    if plan is None:
        plan = cache.verify_plan = VerifyPlan({})
    if rows not in plan.sites:
        plan.sites[rows] = [(_site(layer.attn_hc, rows), _site(layer.ffn_hc, rows)) for layer in model.model.layers]
    return plan.sites[rows]


def block_tokens(blk: _Block, sites: tuple, streams: torch.Tensor, B: int, topk: torch.Tensor | None):
    """DecoderBlock.forward on T tokens per row: streams [R, N, D] -> (streams, this layer's top-k or the carried
    one [B, T, J])."""
    pre, post, comb = _coefficients(sites[0], streams)
    x = _rms(_collapse(pre, streams), *blk.input_norm).view(B, -1, streams.shape[-1])  # [B, T, D]
    if isinstance(blk.attention, _Kda):
        out = kda_tokens(blk.attention, x, blk.cache)
    else:
        out, topk = mla_tokens(blk.attention, x, blk.cache, topk)
    streams = _mix(streams, comb, post, out.reshape(streams.shape[0], -1))
    pre, post, comb = _coefficients(sites[1], streams)
    x = _rms(_collapse(pre, streams), *blk.post_norm)  # [R, D]
    out = _moe_rows(blk.mlp, x) if isinstance(blk.mlp, _Moe) else blk.mlp(x)
    return _mix(streams, comb, post, out), topk


def checked_plan(model: nn.Module, cache: GenerationCache, ids: torch.Tensor):
    """The cache's decode plan (built on first use) for a verify of ids [B, T] (T >= 1, the cache's batch)."""
    check_step_inputs("verify_step", model, cache, ids)
    plan = cache.decode_plan
    if plan is None:
        plan = cache.decode_plan = build_plan(model, cache)
    if ids.dim() != 2 or ids.shape[0] != plan.batch or ids.shape[1] == 0:
        raise CacheError(f"verify_step takes ids of shape ({plan.batch}, T) with T >= 1, got {tuple(ids.shape)}")
    return plan


@torch.inference_mode()
def verify_step(model: nn.Module, cache: GenerationCache, ids: torch.Tensor) -> torch.Tensor:
    """T new tokens per row, ids [B, T] -> the final hidden states [B, T, D] (after the final norm); `cache`
    advances by T. Equals `model.model(ids, cache=cache)` up to fp32 rounding. The cache must be a prefilled
    main-model cache of `model`; when it is marked, what a rewind needs is recorded (speculative decoding)."""
    plan = checked_plan(model, cache, ids)
    B, T = ids.shape
    sites = _sites(model, cache, B * T)
    x = F.embedding(ids.reshape(-1), plan.embed)  # [R, D]
    streams = x[:, None, :].expand(-1, plan.n, -1).contiguous()  # [R, N, D]
    topk = None
    for blk, site in zip(plan.blocks, sites):
        streams, topk = block_tokens(blk, site, streams, B, topk)
    return _rms(streams.mean(dim=1), *plan.norm).view(B, T, -1)


# ------------------------------------------------------------------------------------------------------------ MTP
@dataclass
class MtpPlan:
    """One MTP layer's weights for T-token steps after its cache's prefill (glm53/model/mtp.py: no mHC)."""

    embed: torch.Tensor  # [vocab, D]
    enorm: tuple  # (weight, eps)
    hnorm: tuple
    eh_proj: torch.Tensor  # [D, 2D]
    input_norm: tuple
    post_norm: tuple
    attention: _Mla
    cache: MlaLayerCache
    mlp: _Moe | nn.Module
    compiled: dict = field(default_factory=dict)  # mtp_compiled.py's bound graphs for this plan


def build_mtp_plan(model: nn.Module, layer: nn.Module, cache: GenerationCache) -> MtpPlan:
    """The plan of `layer` (one of model.mtp.layers) for its prefilled `cache` (part "mtp")."""
    lc = cache.layer(layer.self_attn, MlaLayerCache)
    if lc.latent is None:
        raise CacheError("mtp_tokens needs a prefilled MTP cache: run the MTP layer over the prompt first")
    norm = lambda m: (as_local(m, "weight"), m.eps)  # noqa: E731
    return MtpPlan(as_local(model.model.embed_tokens, "weight"), norm(layer.enorm), norm(layer.hnorm),
                   as_local(layer.eh_proj, "weight"), norm(layer.input_layernorm),
                   norm(layer.post_attention_layernorm), _mla(layer.self_attn, lc), lc,
                   _moe(layer.mlp) if hasattr(layer.mlp, "experts") else layer.mlp)  # fmt: skip


@torch.inference_mode()
def mtp_tokens(p: MtpPlan, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MTPLayer.forward on T valid positions per row: hidden [B, T, D], the next ids [B, T] -> h [B, 1, D] (before
    shared_head.norm) at the last position, the only one a draft reads; the MTP cache advances by T (recorded when
    marked)."""
    B = hidden.shape[0]
    embeds = F.embedding(ids, p.embed)  # [B, T, D]
    x = F.linear(torch.cat([_rms(embeds, *p.enorm), _rms(hidden, *p.hnorm)], dim=-1), p.eh_proj)  # [B, T, D]
    attn, _ = mla_tokens(p.attention, _rms(x, *p.input_norm), p.cache, None, queries=1)
    x = x[:, -1] + attn[:, 0]  # [B, D]
    out = _rms(x, *p.post_norm)
    out = _moe_rows(p.mlp, out) if isinstance(p.mlp, _Moe) else p.mlp(out)
    return (x + out)[:, None]


__all__ = ["MtpPlan", "VerifyPlan", "block_tokens", "build_mtp_plan", "cache_tokens", "checked_plan", "kda_tokens",
           "mla_tokens", "mtp_tokens", "verify_step", "verify_topk"]
