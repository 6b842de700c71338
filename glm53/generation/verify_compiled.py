"""The verify step compiled: verify.py's T-token step with its tensor work traced by torch.compile into the same
segment graphs as the compiled decode step (decode_compiled.py), for speculative decoding with
`generate(..., speculative="mtp", compile=True)`.

Legend (glm53/model/__init__.py): B batch, T new tokens per row, R = B*T rows, N mHC streams, D model width, H heads,
K/V head widths, Z kv_lora_rank, W conv width, C = 3*H*K conv channels, J selected key slots.
Everything outside attention is per token, so a segment runs decode_compiled's graph pieces on the R rows (its
`_blocks`): only the KDA blocks differ. KDA runs its recurrent form over the T tokens inside the graph, out of place:
the graph returns the state after every token, the T conv inputs and the new conv history, so a marked cache can
rewind to any of them (KdaLayerCache.record) and the inputs are never written. MLA's cache bookkeeping for the T
tokens (verify.py's cache_tokens: the latents, the indexer's pools steered by host counts, the top-k of every query)
and the gather of each query's selected latent rows run eagerly between the graphs, as in the decode step.
Shapes are static per (config, batch, T): one compile per segment and k = T - 1, reused by every later cache; after
the first call a segment's graph is called directly (decode_compiled._Bound). Results equal verify_step's up to fp32
rounding (tests/generation/test_speculative_compiled.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .cache import GenerationCache
from .decode import _Block, _Kda
from .decode_compiled import (_as, _blocks, _dense, _forget_gate, _linear, _mm, _run, _Segment, _segments, _unit_rms,
                              compiled_segment)  # fmt: skip
from .layers import _cached_attention, _gather_rows
from .verify import cache_tokens, checked_plan


def _kda_tokens(p: _Kda, x: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> tuple:
    """verify.kda_tokens in decode_compiled._kda's form: x [R, D] (row-major by batch) -> (out [R, D], the state
    after each token T x [B, H, K, V], the conv inputs [B, T, C], the new conv history [B, W-1, C])."""
    B, K = state.shape[0], p.head_dim
    R = x.shape[0]
    T = R // B
    qkv_raw, f_a, b, g_a = _linear(x, p.packed[0], p.packed[1]).split(p.packed[2], dim=-1)
    raw = qkv_raw.reshape(B, T, -1)  # [B, T, C]
    full = torch.cat([conv, raw], dim=1)  # [B, W-1+T, C]
    windows = _as(full, torch.float32).unfold(1, p.taps.shape[0], 1)  # [B, T, C, W]: the inputs each output reads
    qkv = _as(F.silu((windows * p.taps.t()).sum(-1)), x.dtype).view(R, 3, -1, 1, K)  # [R, 3, H, 1, K]
    qk = _unit_rms(_as(qkv[:, :2], torch.float32), p.roots[0]) * p.qk_scale  # l2norm (q scaled)
    g = _forget_gate(p, f_a, R)
    dt = state.dtype
    by_token = lambda t: t.reshape(B, T, *t.shape[1:]).unbind(1)  # noqa: E731  [R, ...] -> T x [B, ...]
    q, k, v = by_token(_as(qk[:, 0], dt)), by_token(_as(qk[:, 1], dt)), by_token(_as(qkv[:, 2], dt))
    beta, decay = by_token(_as(torch.sigmoid(b), dt).view(R, -1, 1, 1)), by_token(_as(g, dt).exp())
    S, states, outs = state, [], []
    for t in range(T):  # a new state per token: each stays valid for a rewind
        S = S * decay[t]
        u = (v[t] - _mm(k[t], S)) * beta[t]  # [B, H, 1, V]
        S = S + k[t].transpose(-1, -2) * u
        outs.append(_mm(q[t], S))
        states.append(S)
    o = _as(torch.stack(outs, dim=1), qkv.dtype).view(R, -1, 1, qkv.shape[-1])  # [R, H, 1, V]
    gate = _as(_linear(g_a, p.g_b), torch.float32).view(R, -1, 1, K)
    of = _unit_rms(_as(o, torch.float32), p.roots[1]) * p.norm_scaled * torch.sigmoid(gate)
    history = full[:, T:].clone(memory_format=torch.contiguous_format)  # its own buffer (not a view of `full`)
    return _linear(_as(of, qkv.dtype).view(R, -1), *p.o), states, raw, history


def _verify_segment(seg: _Segment, streams: torch.Tensor, head: tuple, mixer: torch.Tensor | None, states: list,
                    convs: list) -> tuple:  # fmt: skip
    """decode_compiled._segment on R = B*T rows: streams [R, N, D] (ids [R] in the first segment) -> (streams, *the
    tail's outputs, then per KDA block: its T states, conv inputs [B, T, C] and new conv history); nothing written
    in place (the states [B, H, K, V] and conv histories are read only)."""
    kept = []

    def kda(i: int, p: _Kda, x: torch.Tensor) -> torch.Tensor:
        out, after, raw, history = _kda_tokens(p, x, states[i], convs[i])
        kept.extend([*after, raw, history])
        return out

    return (*_blocks(seg, streams, head, mixer, kda), *kept)


def _mla_core(blk: _Block, B: int, x, q_resid, q, latent, x_proj, shared) -> tuple[tuple, torch.Tensor]:
    """The MLA bookkeeping of T tokens between two graphs (eager) -> (the next segment's head, top-k [B, T, J]); the
    head: the absorbed attention's inputs (q [R, H, K], latent rows [R, J, Z], filled [R, J]), or the per-head
    attention's output (out [R, H, V],)."""
    p, cache = blk.attention, blk.cache
    rows = lambda t: t.view(B, -1, t.shape[-1])  # noqa: E731  [R, *] -> [B, T, *]
    x_proj = tuple(rows(t) for t in x_proj) or None
    topk = cache_tokens(p, cache, rows(latent), rows(x), rows(q_resid), shared, x_proj)
    if not p.absorb:
        out = _cached_attention(p.module, q.view(B, -1, *q.shape[1:]), cache, topk)  # [B, T, H, V]
        return (out.flatten(0, 1),), topk
    kv, filled = _gather_rows(cache, topk)  # [B, T, J, Z], [B, T, J]
    return (q, kv.flatten(0, 1), filled.flatten(0, 1)), topk


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> (its DecodePlan, segments, {T: bindings})


def _kda_after(caches: list, T: int, out: list) -> None:
    """Hand each KDA cache what its block's graph returned (trailing `out`: per block T states, inputs, history)."""
    per = T + 2
    for c, i in zip(caches, range(len(out) - per * len(caches), len(out), per)):
        states, raw, history = out[i : i + T], out[i + T], out[i + T + 1]
        if c.marked:
            c.record(list(states), raw)
        c.state, c.conv = states[-1], history
        c.length += T


@torch.inference_mode()
def compiled_verify_step(model, cache: GenerationCache, ids: torch.Tensor, backend: str = "inductor",
                         cpp_wrapper: bool = False) -> torch.Tensor:  # fmt: skip
    """verify_step (same arguments, result and cache effects, marked caches included) with the tensor work compiled
    by `backend` ("inductor"; "aot_eager" traces without code generation). The first call per (config, batch, T)
    compiles."""
    plan = checked_plan(model, cache, ids)
    B, T = ids.shape
    kept = _PLANS.get(cache)
    if kept is None or kept[0] is not plan:
        kept = _PLANS[cache] = (plan, _segments(plan), {})
    bound = kept[2].setdefault(T, [None] * len(kept[1]))
    streams, head, mixer, topk = ids.reshape(-1).clone(), (), None, None  # ids [R]
    compiled = compiled_segment(backend, cpp_wrapper, _verify_segment)
    for k, seg in enumerate(kept[1]):
        caches = [blk.cache for blk in seg.kda]
        states, convs = [_dense(c.state) for c in caches], [_dense(c.conv) for c in caches]
        streams, *out = _run(bound, k, compiled, seg, streams, head, mixer, states, convs)
        _kda_after(caches, T, out)
        if seg.tail is None:
            return out[0].view(B, T, -1)
        x, mixer, q_resid, q, latent, *x_proj = out[: len(out) - (T + 2) * len(caches)]
        head, topk = _mla_core(seg.tail, B, x, q_resid, q, latent, x_proj, topk)
    raise AssertionError("the last segment ends with the final norm")


__all__ = ["compiled_verify_step"]
