"""Cached forwards of the attention layers: prefill over the prompt with the chunked kernels, then decode steps
that read the cache (the recurrent KDA state; the latent rows the indexer selects).

Legend (glm53/model/__init__.py): B batch, T new positions in this forward, S cached positions, D model width,
H heads, K query/key head width (KDA, MLA, the indexer), V value head width, Z kv_lora_rank, L tokens per k-pool,
P k-pools, J selected key slots per query (einsum subscripts: e, f, c stand for K, V, Z).
Each function computes what the layer's own forward computes, term by term (same modules, same kernels, same
fp32 points), so prefill + decode equals one forward over the whole sequence. The layer objects are used through
their attributes only: this module imports nothing from glm53.model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..boundary import as_local
from ..kernels import kernel
from ..kernels.kda import l2norm

L2NORM_EPS = 1e-6  # KimiDeltaAttention's q/k l2norm epsilon (glm53/model/kda.py)


# --------------------------------------------------------------------------------------------------------- KDA
def _short_convs(module, x: torch.Tensor, cache) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """silu(conv(proj(x))) for q, k, v continuing the cached histories -> (outputs, new histories [B, W-1, 3*H*K],
    conv inputs [B, T, 3*H*K])."""
    raw = (module.q_proj(x), module.k_proj(x), module.v_proj(x))  # [B, T, H*K] each
    convs = (module.q_conv1d, module.k_conv1d, module.v_conv1d)
    C = raw[0].shape[-1]
    # the kernel takes each history as [B, H*K, W-1]: views of the cache's time-major [B, W-1, 3*H*K]
    histories = (None,) * 3 if cache.conv is None else \
        tuple(cache.conv[..., i * C : (i + 1) * C].transpose(1, 2) for i in range(3))  # fmt: skip
    outs, states = [], []
    for r, conv, history in zip(raw, convs, histories):
        y, state = kernel("causal_conv1d")(r, as_local(conv, "weight")[:, 0, :], initial_state=history,
                                           output_final_state=True)  # fmt: skip
        outs.append(F.silu(y).to(x.dtype))
        states.append(state.transpose(1, 2))
    return outs, torch.cat(states, dim=-1), torch.cat(raw, dim=-1)


def kda_cached_forward(module, x: torch.Tensor, ctx, cache) -> torch.Tensor:
    """KimiDeltaAttention.forward continuing `cache` (a KdaLayerCache): x [B, T, D] -> [B, T, D].

    The chunked kernel runs a prefill; decode steps (T = 1) take the kernel's recurrent form. While the cache is
    marked (speculative verification) tokens run one at a time and each state is kept for `rewind`.
    """
    cache.check_batch(x.shape[0])
    x = (x * ctx.valid[:, :, None]).to(x.dtype)
    split = lambda t: rearrange(t, "b t (h k) -> b t h k", k=module.head_dim)  # noqa: E731
    (q, k, v), conv_states, raw = _short_convs(module, x, cache)
    q, k, v = split(q), split(k), split(v)
    g = module.forget_gate(x)
    beta = torch.sigmoid(module.b_proj(x))
    q, k = l2norm(q.float(), L2NORM_EPS), l2norm(k.float(), L2NORM_EPS)
    if cache.marked:
        outs, states, S = [], [], cache.state
        for t in range(x.shape[1]):
            o_t, S = kernel("kda")(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                   beta[:, t : t + 1], initial_state=S, output_final_state=True)  # fmt: skip
            outs.append(o_t)
            states.append(S)
        o = torch.cat(outs, dim=1)
        cache.record(states, raw)
    else:
        o, S = kernel("kda")(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
    cache.state, cache.conv = S, conv_states
    cache.length += x.shape[1]
    o = module.o_norm(o.to(v.dtype), split(module.g_b_proj(module.g_a_proj(x))))  # [B, T, H, K]
    return module.o_proj(rearrange(o, "b t h k -> b t (h k)"))


# --------------------------------------------------------------------------------------------------------- MLA
def mla_cached_forward(module, x: torch.Tensor, ctx, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """MultiHeadLatentAttention.forward continuing `cache` (an MlaLayerCache): x [B, T, D] ->
    (out [B, T, D], top-k [B, T, J] positions on the cache's time axis)."""
    valid = ctx.valid
    q_resid = module.q_a_layernorm(module.q_a_proj(x))
    q = rearrange(module.q_b_proj(q_resid), "b t (h e) -> b t h e", e=module.qk_head_dim)
    latent = module.kv_a_layernorm(module.kv_a_proj_with_mqa(x))  # [B, T, Z]
    prefill = cache.length == 0
    if prefill:
        cache.start_rows(valid)
    else:
        cache.advance(valid)
    start = cache.append(latent)
    if module.indexer is not None:
        topk = _prefill_topk(module.indexer, x, q_resid, valid, cache) if prefill else \
            _decode_topk(module.indexer, x, q_resid, valid, cache, start)  # fmt: skip
    elif ctx.shared_topk is None:
        raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
    else:
        topk = ctx.shared_topk
    if prefill:
        o = _prefill_attention(module, q, latent, topk)
    else:
        o = _cached_attention(module, q, cache, topk)
    return module.o_proj(rearrange(o, "b t h f -> b t (h f)")), topk


def _absorbed_weights(module, Z: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj as per-head [H, K, Z] (keys) and [H, V, Z] (values) maps of the latent."""
    w = as_local(module.kv_b_proj, "weight").view(-1, module.qk_head_dim + module.v_head_dim, Z)
    w_uk, w_uv = w.split([module.qk_head_dim, module.v_head_dim], dim=1)
    return w_uk, w_uv


def _prefill_attention(module, q: torch.Tensor, latent: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """The layer's own attention over the prompt (queries and keys are the same positions) -> [B, T, H, V]."""
    if module.absorb:
        w_uk, w_uv = _absorbed_weights(module, latent.shape[-1])
        q_abs = torch.einsum("bthe,hec->bthc", q, w_uk)
        o_latent = kernel("sparse_mqa_attention")(q_abs, latent, topk, module.scale)
        return torch.einsum("bthc,hfc->bthf", o_latent, w_uv)
    k, v = module._expand_kv(latent)
    return kernel("sparse_attention")(q, k, v, topk, module.scale)


def _gather_rows(cache, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's latent [B, capacity, Z], topk [B, T, J] -> (the selected rows [B, T, J, Z], slot is filled
    [B, T, J])."""
    B, cap, Z = cache.latent.shape
    filled = topk >= 0
    rows = (torch.arange(B, device=topk.device) * cap)[:, None, None] + topk.clamp(min=0)
    # index_select on the flattened rows: reads J rows per query straight from the buffer, whatever S is
    return cache.rows(rows.flatten()).view(*topk.shape, Z), filled


def _softmax_slots(scores: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """scores [B, T, H, J] fp32 (scaled) -> probabilities over the filled slots; rows with none -> 0."""
    return torch.softmax(scores.masked_fill(~filled[:, :, None], float("-inf")), dim=-1).nan_to_num(0.0)


def _cached_attention(module, q: torch.Tensor, cache, topk: torch.Tensor) -> torch.Tensor:
    """Decode attention: each query reads only its J selected latent rows of the MlaLayerCache, O(T * J) ->
    [B, T, H, V]."""
    kv, filled = _gather_rows(cache, topk)  # [B, T, J, Z]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if module.absorb:
        w_uk, w_uv = _absorbed_weights(module, kv.shape[-1])
        q_abs = torch.einsum("bthe,hec->bthc", q, w_uk).to(dtype)
        scores = torch.einsum("bthc,btjc->bthj", q_abs, kv.to(dtype)) * module.scale
        o_latent = torch.einsum("bthj,btjc->bthc", _softmax_slots(scores, filled), kv.to(dtype)).to(q.dtype)
        return torch.einsum("bthc,hfc->bthf", o_latent, w_uv)
    B, T, J, Z = kv.shape
    k, v = module._expand_kv(kv.view(B, T * J, Z).to(q.dtype))  # [B, T*J, H, K], [B, T*J, H, V]
    k, v = k.view(B, T, J, *k.shape[2:]).to(dtype), v.view(B, T, J, *v.shape[2:]).to(dtype)
    scores = torch.einsum("bthe,btjhe->bthj", q.to(dtype), k) * module.scale
    return torch.einsum("bthj,btjhf->bthf", _softmax_slots(scores, filled), v).to(q.dtype)


# ----------------------------------------------------------------------------------------------------- indexer
def _prefill_topk(indexer, x, q_resid, valid, cache) -> torch.Tensor:
    """The indexer's own selection over the prompt; keeps its complete pools and each row's pool being filled."""
    pool_keys, positions, complete = indexer.pools(x, valid)  # [B, P, K], [B, P, L], [B, P]
    scores = indexer.scores(x, q_resid, pool_keys)
    topk = indexer.select(scores, positions, complete, valid)[0]
    cache.start_pools(*_pool_state(indexer, x, cache, pool_keys, complete), indexer_ape(indexer))
    return topk


def indexer_ape(indexer) -> torch.Tensor:
    return as_local(indexer, "index_kpool_compress_ape")  # [L, K]


def _token_keys(indexer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token indexer keys [.., K] and fp32 pooling-gate logits [.., K] (Indexer.pools, before pooling)."""
    keys = indexer.k_norm(indexer.wk(x))
    gate = F.linear(x, as_local(indexer, "index_kpool_compress_gate")).float()
    return keys, gate


def _pool_state(indexer, x, cache, pool_keys, complete) -> tuple[torch.Tensor, ...]:
    """-> (pooled keys [B, P, K], complete pools [B], the filling pool's keys [B, L, K], gate [B, L, K], its
    token count [B])."""
    B, T = x.shape[:2]
    L = indexer.kpool
    n_pools = complete.long().sum(-1)  # [B] complete pools are a prefix of each row's pools
    partial = cache.count - n_pools * L  # [B] tokens of the pool being filled
    offsets = torch.arange(L, device=x.device)
    pos = cache.first[:, None] + n_pools[:, None] * L + offsets  # [B, L]
    filled = offsets < partial[:, None]
    batch = torch.arange(B, device=x.device)[:, None]
    keys, gate = _token_keys(indexer, x[batch, pos.clamp(max=T - 1)])  # [B, L, K] each
    keys = keys.masked_fill(~filled[..., None], 0)
    gate = gate.masked_fill(~filled[..., None], 0)
    return pool_keys.clone(), n_pools, keys, gate, partial


def _decode_topk(indexer, x, q_resid, valid, cache, start: int) -> torch.Tensor:
    """Top-k for T decode queries at positions start .. start+T-1 against the cached pools -> [B, T, J]."""
    B, T = valid.shape
    L = indexer.kpool
    keys, gate = _token_keys(indexer, x)
    ape = indexer_ape(indexer)
    for t in range(T):
        cache.push_pool_token(keys[:, t], gate[:, t], ape, valid[:, t])
    ps = cache.pools
    P = cache.max_count // L  # pools some row has completed
    scores = indexer.scores(x, q_resid, ps.keys[:, :P])  # [B, T, P] fp32
    query_pos = start + torch.arange(T, device=x.device)
    pool = torch.arange(P, device=x.device)
    pool_end = cache.first[:, None] + (pool + 1) * L - 1  # [B, P] a pool's last position
    candidate = (pool[None] < ps.count[:, None])[:, None] & (pool_end[:, None, :] <= query_pos[None, :, None])
    scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
    select = min(indexer.index_topk // L, P)
    chosen = scores.topk(select, dim=-1).indices  # [B, T, select]
    chosen_ok = candidate.gather(-1, chosen)
    tokens = cache.first[:, None, None, None] + chosen[..., None] * L + torch.arange(L, device=x.device)
    topk = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)
    if indexer.select_tail:
        topk = torch.cat([topk, _decode_tail(cache.count, query_pos, T, L)], dim=-1)
    topk = F.pad(topk, (0, indexer.num_slots - topk.shape[-1]), value=-1)[..., : indexer.num_slots]
    return topk.masked_fill(~valid[..., None], -1)


def _decode_tail(count: torch.Tensor, query_pos: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """Each query's visible tokens of its row's incomplete pool (Indexer.visible_tail) -> [B, T, L-1]."""
    seen = count[:, None] - (T - 1 - torch.arange(T, device=count.device))  # [B, T] tokens up to each query
    tail = seen.remainder(L)
    offsets = torch.arange(L - 1, device=count.device)
    idx = (query_pos[None, :] - tail + 1)[..., None] + offsets  # [B, T, L-1]
    return idx.masked_fill(offsets >= tail[..., None], -1)


__all__ = ["kda_cached_forward", "mla_cached_forward"]
