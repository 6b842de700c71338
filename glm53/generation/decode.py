"""The decode step: one new token per row (T = 1) through the whole model, reading and extending a prefilled
GenerationCache. `generate` runs it for every token after the prompt.

Legend (glm53/model/__init__.py): B batch, N mHC streams, D model width, H heads (of MLA, KDA or the indexer),
K query/key head width, V value head width, Z kv_lora_rank, W conv width, L tokens per k-pool, P k-pools,
J selected key slots.
It computes what `Glm53Model.forward(ids[:, None], cache=cache)` computes (the generic cached path: the model's
blocks calling layers.py), formula by formula in the same dtypes; only the bookkeeping around the arithmetic differs:
- no time axis (every [B, 1, ...] tensor is [B, ...]), no padding mask, no host read of the ids (model picks);
- what depends only on the weights is made once per cache (`DecodePlan`): local weight views, each mHC site's
  scale and bias vectors, KDA's exp(A_log) and its three conv kernels side by side, MLA's absorbed per-head maps;
  derived weights (linears that read the same input stacked into one: KDA's six input projections, MLA's q_a, kv_a
  and indexer projections, an MLP's gate | up; the mHC projection with its scale folded in) are kept once per
  module (`_derived`: shared by every cache, rebuilt when a source weight changes in place);
- for B <= 4 rows on the CPU (N = 4) the mHC gates, softmax and Sinkhorn are host scalar arithmetic on the 24
  projected numbers per row (decode_host.py: one tolist and one tensor instead of ~90 dispatched ops), laid out as
  pre [B, 1, N] and [comb^T | post] so the collapse and the mix are one bmm each; otherwise Sinkhorn's row and
  column sums are one baddbmm each, with eps as the added input, into preallocated buffers;
- RMS norms and l2norm are x / hypot(||x||, sqrt(eps')) (two cheap calls; F.rms_norm decomposes into several on
  the CPU), the weight carrying sqrt(D); normalise-then-project for mHC (kernels/hc_project.py's reference form);
- the indexer's k-pool bookkeeping is steered by the per-row token counts the cache keeps on the host;
- a MoE layer runs one GEMV pair per chosen expert (the chosen experts are read on the host; for one token the
  router is inlined: the tensor top-k, the renormalisation of the k weights on the host).
A step is ~0.9k small ops at B = 1 (bench config; tests/generation/test_decode_ops.py bounds the tiny config's):
its cost is per-op overhead and weight reads (the GEMVs are about half of it), not arithmetic. The results equal
the generic path's up to fp32 rounding (GEMM and reduction order, fp64 host scalars), not bit for bit
(tests/generation/test_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundary import as_local
from .cache import CacheError, GenerationCache, KdaLayerCache, MlaLayerCache, _grow, check_step_inputs
from .decode_common import _absorbed_attention, _as, _derived, _packed_linears, _rms, _unit_rms, _weight  # noqa: F401 (verify.py)
from .decode_host import host_coefficients, host_mixers, use_host
from .decode_moe import _Mlp, _mlp, _Moe, _moe, _moe_step  # noqa: F401 (verify.py, tests)
from .layers import L2NORM_EPS

KDA_RECURRENT_DTYPE = torch.float32  # the kda kernels compute in fp32 (fp64 only for fp64 inputs)


# ------------------------------------------------------------------------------------------------------------ mHC
@dataclass
class _Site:
    """One mHC site (HyperConnection): its projection and the scale / bias of the (2+N)*N coefficients."""

    fn: torch.Tensor  # [(2+N)*N, N*D] fp32, each row times its coefficient's scale
    scale: torch.Tensor  # [(2+N)*N] fp32: scale[0] for pre, scale[1] for post, scale[2] for comb
    base: torch.Tensor  # [(2+N)*N] fp32
    n: int
    eps: float
    norm_eps: float
    iters: int
    ones_col: torch.Tensor  # [B, N, 1] ones: row sums as a product
    ones_row: torch.Tensor  # [B, 1, N]
    eps_col: torch.Tensor  # [B, N, 1] eps: added by the same product
    eps_row: torch.Tensor  # [B, 1, N]
    rows: torch.Tensor  # [B, N, 1] scratch for the row sums
    cols: torch.Tensor  # [B, 1, N] scratch for the column sums
    root: torch.Tensor | None = None  # sqrt(N*D norm_eps): the normalisation as _unit_rms (fn carries sqrt(N*D))


def _site(hc: nn.Module, B: int) -> _Site:
    n = hc.n
    scale = as_local(hc, "scale").float()
    counts = torch.tensor([n, n, n * n], device=scale.device)
    fp32 = dict(dtype=torch.float32, device=scale.device)
    scale = scale.repeat_interleave(counts)
    fn = as_local(hc, "fn")
    # scale * (fn x) + base as one linear: the scale folded into fn's rows, base as the bias
    root = fn.shape[-1] ** 0.5  # _unit_rms leaves out rms_norm's sqrt(N*D): folded into fn with the scale
    scaled = _derived(hc, "fn", [fn, as_local(hc, "scale")], lambda: fn.float() * (scale[:, None] * root))
    return _Site(scaled, scale, as_local(hc, "base").float(), n,
                 hc.eps, hc.norm_eps, hc.sinkhorn_iters, torch.ones(B, n, 1, **fp32), torch.ones(B, 1, n, **fp32),
                 torch.full((B, n, 1), hc.eps, **fp32), torch.full((B, 1, n), hc.eps, **fp32),
                 torch.empty(B, n, 1, **fp32), torch.empty(B, 1, n, **fp32),
                 torch.tensor(root * hc.norm_eps**0.5, **fp32))  # fmt: skip


def _sinkhorn(site: _Site, c: torch.Tensor) -> torch.Tensor:
    """kernels/sinkhorn.py in place on c [B, N, N] fp32: columns, then (iters - 1) x (rows, columns), sums + eps."""
    rows, cols = site.rows, site.cols
    c.div_(torch.baddbmm(site.eps_row, site.ones_row, c, out=cols))
    for _ in range(site.iters - 1):
        c.div_(torch.baddbmm(site.eps_col, c, site.ones_col, out=rows))
        c.div_(torch.baddbmm(site.eps_row, site.ones_row, c, out=cols))
    return c


def _logits(site: _Site, streams: torch.Tensor) -> torch.Tensor:
    """scale * (projected, normalised streams) + base: streams [B, N, D] -> z [B, (2+N)*N] fp32."""
    flat = _as(streams.reshape(streams.shape[0], -1), torch.float32)  # [B, N*D]
    # normalise, then project (kernels/hc_project.py's reference form); the scale is folded into fn, base the bias
    return F.linear(_unit_rms(flat, site.root), site.fn, site.base)


def _coefficients(site: _Site, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HyperConnection.coefficients for streams [B, N, D] -> pre [B, N], post [B, N], comb [B, N, N] (fp32)."""
    B, n = streams.shape[0], site.n
    z = _logits(site, streams)
    if use_host(z, n):  # up to HOST_ROWS rows on the CPU: the 24 numbers per row as host scalars (decode_host.py)
        return host_coefficients(z, n, site.eps, site.iters)
    gates = torch.sigmoid(z[:, : 2 * n])
    pre = gates[:, :n] + site.eps
    post = 2 * gates[:, n:]
    comb = torch.softmax(z[:, 2 * n :].view(B, n, n), dim=-1) + site.eps
    return pre, post, _sinkhorn(site, comb)


def _mixers(site: _Site, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_coefficients in the decode step's layout: pre [B, 1, N] and the mixer [B, N, N+1] = [comb^T | post]."""
    z = _logits(site, streams)
    if use_host(z, site.n):
        return host_mixers(z, site.n, site.eps, site.iters)
    pre, post, comb = _coefficients(site, streams)
    return pre[:, None], torch.cat([comb.transpose(1, 2), post[:, :, None]], dim=-1)


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j x_j in fp32 -> [B, D] in streams' dtype (kernels/hc_collapse.py); pre [B, N] or [B, 1, N]."""
    pre = pre if pre.dim() == 3 else pre[:, None, :]
    return _as(torch.bmm(pre, _as(streams, torch.float32)).view(streams.shape[0], -1), streams.dtype)


def _mix(streams: torch.Tensor, comb: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """new_i = post_i out + sum_j comb_ji x_j [B, N, D] in streams' dtype (kernels/hc_mix.py)."""
    dtype = streams.dtype
    new = torch.bmm(_as(comb, dtype).transpose(1, 2), streams)
    return new.addcmul_(_as(post, dtype)[:, :, None], _as(out, dtype)[:, None, :])


def _mix_step(streams: torch.Tensor, mixer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """_mix as one product: [comb^T | post] @ [streams; out] -> [B, N, D] in streams' dtype."""
    dtype = streams.dtype
    return torch.bmm(_as(mixer, dtype), torch.cat([streams, _as(out, dtype)[:, None, :]], dim=1))


# ------------------------------------------------------------------------------------------------------------ KDA
@dataclass
class _Kda:
    """KimiDeltaAttention's weights and constants for a decode step."""

    proj: list  # (weight, bias) of q, k, v, f_a, b, g_a: the linears that read x
    f_b: torch.Tensor
    g_b: torch.Tensor
    o: tuple
    taps: torch.Tensor  # [W, 3*H*K] fp32: the q | k | v conv kernels, time-major
    dt_bias: torch.Tensor  # [H*K] fp32
    rate: torch.Tensor  # [H, 1, 1] fp32 exp(A_log)
    lower_bound: float | None
    head_dim: int
    norm_weight: torch.Tensor
    norm_eps: float
    packed: tuple = ()  # (weight, bias, sizes): the six input projections as one linear, split q|k|v, f_a, b, g_a
    neg_rate: torch.Tensor | None = None  # -rate
    qk_scale: torch.Tensor | None = None  # [2, 1, 1, 1]: q's K^-0.5 score scale (1 for k)
    roots: tuple = ()  # (sqrt(l2norm eps), sqrt(K o_norm eps)) for _unit_rms
    norm_scaled: torch.Tensor | None = None  # o_norm's weight * sqrt(K)


def _kda(module: nn.Module) -> _Kda:
    proj = [_weight(m) for m in (module.q_proj, module.k_proj, module.v_proj, module.f_a_proj, module.b_proj,
                                 module.g_a_proj)]  # fmt: skip
    taps = torch.cat([as_local(c, "weight")[:, 0, :] for c in (module.q_conv1d, module.k_conv1d, module.v_conv1d)])
    rate = as_local(module, "A_log").float().exp()[:, None, None]
    K = module.head_dim
    fp32 = dict(dtype=torch.float32, device=rate.device)
    qk_scale = torch.tensor([K**-0.5, 1.0], **fp32).view(2, 1, 1, 1)
    roots = (torch.tensor(L2NORM_EPS**0.5, **fp32), torch.tensor((K * module.o_norm.eps) ** 0.5, **fp32))
    norm_weight = as_local(module.o_norm, "weight").float()
    weight, bias, sizes = _packed_linears(module, "proj", proj)
    return _Kda(proj, as_local(module.f_b_proj, "weight"), as_local(module.g_b_proj, "weight"), _weight(module.o_proj),
                taps.float().t().contiguous(), as_local(module, "dt_bias").float(), rate, module.lower_bound, K,
                norm_weight, module.o_norm.eps, (weight, bias, [sum(sizes[:3]), *sizes[3:]]), -rate, qk_scale, roots,
                norm_weight * K**0.5)  # fmt: skip


def _kda_step(p: _Kda, x: torch.Tensor, cache: KdaLayerCache) -> torch.Tensor:
    """KimiDeltaAttention on one token: x [B, D] -> [B, D]; the state advances in place. Per head the token's
    vectors are kept as [B, H, 1, K] rows, so the delta rule's products are plain matmuls on the state. Each
    formula takes its fewest-op form (one packed input projection, the dt bias inside the f_b linear, in-place
    updates of the state)."""
    B, K = x.shape[0], p.head_dim
    qkv_raw, f_a, b, g_a = F.linear(x, p.packed[0], p.packed[1]).split(p.packed[2], dim=-1)
    full = torch.cat([cache.conv, qkv_raw[:, None]], dim=1)  # [B, W, 3*H*K]
    qkv = _as(F.silu((_as(full, torch.float32) * p.taps).sum(1)), x.dtype).view(B, 3, -1, 1, K)  # [B, 3, H, 1, K]
    qk = _unit_rms(_as(qkv[:, :2], torch.float32), p.roots[0]).mul_(p.qk_scale)  # l2norm (q scaled)
    if p.f_b.dtype == torch.float32:
        raw = F.linear(f_a, p.f_b, p.dt_bias).view(B, -1, K, 1)  # [B, H, K, 1]
    else:
        raw = (_as(F.linear(f_a, p.f_b), torch.float32) + p.dt_bias).view(B, -1, K, 1)
    if p.lower_bound is not None:
        g = p.lower_bound * torch.sigmoid(p.rate * raw)
    else:
        g = p.neg_rate * F.softplus(raw, threshold=20.0)
    dt = KDA_RECURRENT_DTYPE if x.dtype != torch.float64 else torch.float64
    q, k, v = _as(qk[:, 0], dt), _as(qk[:, 1], dt), _as(qkv[:, 2], dt)  # [B, H, 1, K]
    beta = _as(torch.sigmoid(b), dt).view(B, -1, 1, 1)
    S = cache.state  # [B, H, K, V], owned by the cache (not marked: decode_step checks)
    S.mul_(_as(g, dt).exp())
    u = (v - torch.matmul(k, S)).mul_(beta)  # [B, H, 1, V]
    S.addcmul_(k.transpose(-1, -2), u)
    o = _as(torch.matmul(q, S), qkv.dtype)  # [B, H, 1, V]
    cache.conv = full[:, 1:]
    cache.length += 1
    gate = _as(F.linear(g_a, p.g_b), torch.float32).view(B, -1, 1, K)
    of = _unit_rms(_as(o, torch.float32), p.roots[1]).mul_(p.norm_scaled).mul_(torch.sigmoid(gate))
    return F.linear(_as(of, qkv.dtype).view(B, -1), *p.o)


# ------------------------------------------------------------------------------------------------------------ MLA
@dataclass
class _Indexer:
    """The DSA indexer's weights and the row layout its decode step needs."""

    wq_b: torch.Tensor
    wk: torch.Tensor
    k_norm: tuple  # (weight, bias, eps) of the key LayerNorm
    weights_proj: torch.Tensor
    gate: torch.Tensor  # [K, D] index_kpool_compress_gate
    ape: torch.Tensor  # [L, K] fp32
    n_heads: int
    head_dim: int
    L: int
    select: int  # index_topk // L pools at most
    tail: bool  # index_kpool_always_select_tail
    num_slots: int
    token_offsets: torch.Tensor  # [B, 1, L] each row's first position + 0 .. L-1


@dataclass
class _Mla:
    """MultiHeadLatentAttention's weights for a decode step (absorbed maps, the indexer when it has one)."""

    module: nn.Module
    q_a: tuple
    q_a_norm: tuple  # (weight, eps)
    q_b: torch.Tensor
    kv_a: tuple
    kv_norm: tuple
    o: tuple
    w_uk: torch.Tensor  # [H, K, Z]
    w_uv_t: torch.Tensor  # [H, Z, V]
    qk_head_dim: int
    scale: float
    absorb: bool
    indexer: _Indexer | None
    packed: tuple = ()  # (weight, bias, sizes): q_a, kv_a (and the indexer's wk, gate, weights_proj) as one linear


def _indexer(indexer: nn.Module | None, cache: MlaLayerCache) -> _Indexer | None:
    if indexer is None:
        return None
    L = indexer.kpool
    offsets = cache.first[:, None, None] + torch.arange(L, device=cache.first.device)
    return _Indexer(as_local(indexer.wq_b, "weight"), as_local(indexer.wk, "weight"),
                    (as_local(indexer.k_norm, "weight"), as_local(indexer.k_norm, "bias"), indexer.k_norm.eps),
                    as_local(indexer.weights_proj, "weight"), as_local(indexer, "index_kpool_compress_gate"),
                    as_local(indexer, "index_kpool_compress_ape").float(), indexer.n_heads, indexer.head_dim, L,
                    indexer.index_topk // L, indexer.select_tail, indexer.num_slots, offsets)  # fmt: skip


def _mla(module: nn.Module, cache: MlaLayerCache) -> _Mla:
    w = as_local(module.kv_b_proj, "weight")
    w = w.view(-1, module.qk_head_dim + module.v_head_dim, w.shape[-1])
    w_uk, w_uv = w.split([module.qk_head_dim, module.v_head_dim], dim=1)  # [H, K, Z], [H, V, Z]
    return _Mla(module, _weight(module.q_a_proj), (as_local(module.q_a_layernorm, "weight"), module.q_a_layernorm.eps),
                as_local(module.q_b_proj, "weight"), _weight(module.kv_a_proj_with_mqa),
                (as_local(module.kv_a_layernorm, "weight"), module.kv_a_layernorm.eps), _weight(module.o_proj),
                w_uk, w_uv.transpose(1, 2), module.qk_head_dim, module.scale, module.absorb,
                _indexer(module.indexer, cache), _packed_mla(module))  # fmt: skip


def _packed_mla(module: nn.Module) -> tuple:
    """The linears that read the block input x (q_a, kv_a; the indexer's wk, gate and weights_proj when the layer
    has its own indexer) stacked into one (weight, bias, sizes): one GEMV per step instead of five."""
    proj = [_weight(module.q_a_proj), _weight(module.kv_a_proj_with_mqa)]
    if module.indexer is not None:
        ix = module.indexer
        proj += [(as_local(ix.wk, "weight"), None), (as_local(ix, "index_kpool_compress_gate"), None),
                 (as_local(ix.weights_proj, "weight"), None)]  # fmt: skip
    return _packed_linears(module, "x_proj", proj) if len({w.dtype for w, _ in proj}) == 1 else ()


def _push_pool_token(p: _Indexer, cache: MlaLayerCache, key: torch.Tensor, gate: torch.Tensor) -> None:
    """MlaLayerCache.push_pool_token for all-valid rows, steered by the host counts (before this token)."""
    ps, L = cache.pools, p.L
    B = key.shape[0]
    slots = [c % L for c in cache.counts_host]
    if len(set(slots)) == 1:
        ps.partial_keys[:, slots[0]] = _as(key, ps.partial_keys.dtype)
        ps.partial_gate[:, slots[0]] = gate
    else:
        rows, at = torch.arange(B, device=key.device), torch.tensor(slots, device=key.device)
        ps.partial_keys[rows, at] = _as(key, ps.partial_keys.dtype)
        ps.partial_gate[rows, at] = gate
    ps.partial_count = ps.partial_count + 1
    done = [b for b, s in enumerate(slots) if s == L - 1]
    if not done:
        return
    ps.keys = _grow(ps.keys, (cache.max_count + 1) // L + 1)
    pick = slice(None) if len(done) == B else torch.tensor(done, device=key.device)
    weights = torch.nan_to_num((ps.partial_gate[pick] + p.ape).softmax(dim=1)).to(ps.partial_keys.dtype)
    pooled = (weights * ps.partial_keys[pick]).sum(dim=1)  # [len(done), K]
    for i, b in enumerate(done):
        ps.keys[b, cache.counts_host[b] // L] = pooled[i]
    finished = torch.zeros(B, dtype=torch.bool, device=key.device)
    finished[done] = True
    ps.count = ps.count + finished.long()
    ps.partial_count = ps.partial_count.masked_fill(finished, 0)


def _decode_topk(p: _Indexer, cache: MlaLayerCache, x: torch.Tensor, q_resid: torch.Tensor, start: int,
                 x_proj: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """The indexer's selection for the token at position `start` against the cached pools -> [B, J]. x_proj: x's
    wk, gate and weights_proj products when already made (the packed projection)."""
    B, L = x.shape[0], p.L
    if x_proj is None:
        x_proj = (F.linear(x, p.wk), F.linear(x, p.gate), F.linear(x, p.weights_proj))
    key = F.layer_norm(x_proj[0], (p.head_dim,), *p.k_norm)  # [B, K]
    _push_pool_token(p, cache, key, _as(x_proj[1], torch.float32))
    counts = [c + 1 for c in cache.counts_host]  # tokens per row, this one included
    ps = cache.pools
    P = (cache.max_count + 1) // L
    q = F.linear(q_resid, p.wq_b).view(B, p.n_heads, p.head_dim)
    w = _as(x_proj[2], torch.float32) * p.n_heads**-0.5  # [B, H]
    keys = _as(ps.keys[:, :P], torch.float32).transpose(-1, -2)  # [B, K, P]
    logits = F.relu(torch.matmul(_as(q, torch.float32), keys) * p.head_dim**-0.5)
    scores = torch.matmul(w[:, None, :], logits)[:, 0]  # [B, P] fp32
    uniform = all(c // L == P for c in counts)  # every row has all P pools: each is a candidate
    if not uniform:
        candidate = torch.arange(P, device=x.device) < ps.count[:, None]
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
    chosen = scores.topk(min(p.select, P), dim=-1).indices  # [B, select]
    tokens = chosen[..., None] * L + p.token_offsets  # [B, select, L]
    if not uniform:
        tokens = tokens.masked_fill(~candidate.gather(-1, chosen)[..., None], -1)
    parts = [tokens.flatten(1)]
    if p.tail:  # the visible tokens of the pool being filled (Indexer.visible_tail)
        tails = [c % L for c in counts]
        parts.append(torch.tensor([[start - t + 1 + o if o < t else -1 for o in range(L - 1)] for t in tails],
                                  dtype=torch.long, device=x.device))  # fmt: skip
    topk = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if topk.shape[-1] < p.num_slots:
        topk = F.pad(topk, (0, p.num_slots - topk.shape[-1]), value=-1)
    return topk


def _append(cache: MlaLayerCache, latent: torch.Tensor) -> int:
    """Write the token's latent [B, Z] at the next position -> that position (MlaLayerCache.append)."""
    start = cache.length
    if cache.latent.shape[1] <= start:
        cache.ensure(start + 1)
    cache.write(start, latent[:, None])
    return start


def _attention(p: _Mla, q: torch.Tensor, cache: MlaLayerCache, topk: torch.Tensor) -> torch.Tensor:
    """layers._cached_attention for one query per row: q [B, H, K], topk [B, J] -> [B, H, V]."""
    B, cap, Z = cache.latent.shape
    filled = topk >= 0
    rows = topk.clamp(min=0)
    if B > 1:
        rows = rows + (torch.arange(B, device=topk.device) * cap)[:, None]
    kv = cache.rows(rows.flatten()).view(B, -1, Z)  # [B, J, Z]
    if p.absorb:
        return _absorbed_attention(p, q, kv, filled)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = p.module._expand_kv(kv.to(q.dtype))  # [B, J, H, K], [B, J, H, V]
    scores = torch.einsum("bhe,bjhe->bhj", q.to(dtype), k.to(dtype)) * p.scale
    probs = torch.softmax(scores.masked_fill(~filled[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhj,bjhf->bhf", probs, v.to(dtype)).to(q.dtype)


def _cache_token(p: _Mla, cache: MlaLayerCache, latent: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                 x_proj: list | None, shared: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The MLA cache's bookkeeping for one token: append its latent [B, Z], pick its top-k [B, J] (its own indexer
    or the shared one), advance the lengths and counts -> top-k."""
    start = _append(cache, latent)
    if p.indexer is not None:
        topk = _decode_topk(p.indexer, cache, x, q_resid, start, x_proj or None)
    elif shared is None:
        raise ValueError("a 'shared' indexer layer needs the top-k of an earlier 'full' layer (got none)")
    else:
        topk = shared
    cache.length = start + 1
    cache.count = cache.count + 1
    cache.max_count += 1
    cache.counts_host = [c + 1 for c in cache.counts_host]
    return topk


def _mla_step(p: _Mla, x: torch.Tensor, cache: MlaLayerCache,
              shared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """MultiHeadLatentAttention on one token: x [B, D] -> (out [B, D], top-k [B, J])."""
    B = x.shape[0]
    if p.packed:
        q_a, kv_a, *x_proj = F.linear(x, p.packed[0], p.packed[1]).split(p.packed[2], dim=-1)
    else:
        q_a, kv_a, x_proj = F.linear(x, *p.q_a), F.linear(x, *p.kv_a), None
    q_resid = _rms(q_a, *p.q_a_norm)  # [B, R]
    q = F.linear(q_resid, p.q_b).view(B, -1, p.qk_head_dim)  # [B, H, K]
    latent = _rms(kv_a, *p.kv_norm)  # [B, Z]
    topk = _cache_token(p, cache, latent, x, q_resid, x_proj, shared)
    o = _attention(p, q, cache, topk)
    return F.linear(o.reshape(B, -1), *p.o), topk


# ---------------------------------------------------------------------------------------------------- block loop
@dataclass
class _Block:
    attn_site: _Site
    ffn_site: _Site
    input_norm: tuple  # (weight, eps)
    post_norm: tuple
    attention: _Kda | _Mla
    cache: KdaLayerCache | MlaLayerCache
    mlp: _Moe | _Mlp | nn.Module  # an MLP is called as is ([B, D] in and out)


@dataclass
class DecodePlan:
    """Per-layer constants of the decode step for one (model, prefilled cache) pair."""

    blocks: list
    embed: torch.Tensor  # [vocab, D]
    norm: tuple  # the final RMSNorm (weight, eps)
    n: int
    batch: int


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return as_local(norm, "weight"), norm.eps


def build_plan(model: nn.Module, cache: GenerationCache) -> DecodePlan:
    """Check that `cache` is a prefilled main-model cache of `model` and make the plan (once per cache)."""
    if cache.part != "main" or cache.model_id != id(model):
        raise CacheError("this generation cache was built for another model (or its MTP part): decode_step needs "
                         "the main-model cache of the same model")  # fmt: skip
    blocks, batch = [], None
    for layer in model.model.layers:
        is_kda = layer.is_linear
        lc = cache.layer(layer.self_attn, KdaLayerCache if is_kda else MlaLayerCache)
        if (lc.state if is_kda else lc.latent) is None:
            raise CacheError("decode_step needs a prefilled cache: run model.model(prompt, mask, cache=cache) first")
        batch = (lc.state if is_kda else lc.latent).shape[0]
        attention = _kda(layer.self_attn) if is_kda else _mla(layer.self_attn, lc)
        blocks.append(_Block(_site(layer.attn_hc, batch), _site(layer.ffn_hc, batch), _norm(layer.input_layernorm),
                             _norm(layer.post_attention_layernorm), attention, lc,
                             _moe(layer.mlp) if hasattr(layer.mlp, "experts") else _mlp(layer.mlp)))  # fmt: skip
    embed = as_local(model.model.embed_tokens, "weight")
    return DecodePlan(blocks, embed, _norm(model.model.norm), model.config.hc_mult, batch)


def _block_step(blk: _Block, streams: torch.Tensor, topk: torch.Tensor | None):
    """DecoderBlock.forward on one token: streams [B, N, D] -> (streams, this layer's top-k or the carried one)."""
    pre, mixer = _mixers(blk.attn_site, streams)
    x = _rms(_collapse(pre, streams), *blk.input_norm)
    if isinstance(blk.attention, _Kda):
        out = _kda_step(blk.attention, x, blk.cache)
    else:
        out, topk = _mla_step(blk.attention, x, blk.cache, topk)
    streams = _mix_step(streams, mixer, out)
    pre, mixer = _mixers(blk.ffn_site, streams)
    x = _rms(_collapse(pre, streams), *blk.post_norm)
    out = _moe_step(blk.mlp, x) if isinstance(blk.mlp, _Moe) else blk.mlp(x)
    return _mix_step(streams, mixer, out), topk


@torch.inference_mode()
def decode_step(model: nn.Module, cache: GenerationCache, ids: torch.Tensor) -> torch.Tensor:
    """One new token per row, ids [B] -> the final hidden state [B, D] (after the final norm); `cache` advances.

    Equals `model.model(ids[:, None], cache=cache)[:, 0]` up to fp32 rounding. The cache must be a prefilled,
    unmarked main-model cache of `model` (speculative verification: verify.py's T-token step).
    """
    check_step_inputs("decode_step", model, cache, ids)
    plan = cache.decode_plan
    if plan is None:
        plan = cache.decode_plan = build_plan(model, cache)
    if cache.marked:
        raise CacheError("decode_step cannot run on a marked cache (rewind() it first)")
    if ids.shape != (plan.batch,):
        raise CacheError(f"decode_step takes ids of shape ({plan.batch},), got {tuple(ids.shape)}")
    x = F.embedding(ids, plan.embed)  # [B, D]
    streams = x[:, None, :].expand(-1, plan.n, -1).contiguous()  # [B, N, D]
    topk = None
    for blk in plan.blocks:
        streams, topk = _block_step(blk, streams, topk)
    return _rms(streams.mean(dim=1), *plan.norm)


__all__ = ["DecodePlan", "build_plan", "decode_step"]
