"""The decode step compiled: decode.py's step with its tensor work traced by torch.compile into a few graphs
(`generate(..., compile=True)`: inductor with its C++ wrapper).

Legend (glm53/model/__init__.py): B batch, N mHC streams, D model width, H heads, K/V head widths, Z kv_lora_rank,
E routed experts, I expert width, k experts per token, J selected key slots.
The layers run as segments: each MLA layer's cache bookkeeping (the latent append, the indexer's pools and scores
steered by host counts, the gather of the selected latent rows: decode.py's code, run eagerly) splits the step, and
everything between two of them is one compiled graph: [embedding, KDA blocks, the next MLA block up to its
projections], [that block's attention over the gathered rows, output projection and feed-forward half, KDA
blocks, the next MLA block's projections], ..., [the final norm]. A graph sees no host-side length, so its shapes
never change from token to token (one compile per segment layout, config and batch; a new cache reuses them):
- the mHC coefficients are tensor ops (sigmoid gates, the row softmax, Sinkhorn's sums) instead of
  decode_host.py's host scalars;
- KDA updates its recurrent state and conv history in place (buffers of its own: `_owned`);
- MoE picks its experts with the tensor top-k and reads their weights by index, instead of the host loop;
- every product with a weight and the small batched products (mHC collapse and mix, the KDA state reads) are
  written as products summed (`_linear`, `_mm`): inductor makes them vectorised reductions fused with the
  elementwise work around them, faster at one to a few rows than external GEMV calls, and a gathered expert
  weight is never copied.
After a segment's first step its graph is called directly (`_Bound`), not through dynamo, whose guards over the
few hundred weight tensors a segment reads cost more than the graph's elementwise work: the weights are the plan's
(fixed per cache), the per-step inputs are checked against the layouts the graph was made for (dynamo runs the
step otherwise).
Results equal decode_step's up to fp32 rounding (summation order), and the full forward at the same tolerances
(tests/generation/test_decode_compiled.py). The first step compiles: about a minute on 2 CPU cores for the bench
config (seconds when inductor's on-disk cache already holds the graphs).
Speculative decoding reuses this machinery: the graph pieces run on any number of rows (`_blocks`), so
verify_compiled.py's T-token segments differ only in their KDA blocks, and mtp_compiled.py makes the MTP draft step's
two graphs with `compiled_segment` and `_call`.
"""

from __future__ import annotations

import functools
import shutil
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.moe import clamped_swiglu_packed
from ..model.moe import NORM_EPS
from .cache import CacheError, GenerationCache, GenerationError, check_step_inputs
from .decode import (_Block, _Kda, _Mla, _Mlp, _Moe, _Site, _absorbed_attention, _as, _attention, _cache_token,
                     _unit_rms, build_plan)  # fmt: skip
from .decode import decode_step

RECOMPILE_LIMIT = 64  # graphs kept per compiled function: one per (segment layout, config, batch) in a process
SMALL_ROWS = 4  # up to this many rows a product with a weight is written as products summed (see _linear)


# ----------------------------------------------------------------------------------------------- graph pieces
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a few rows x [..., D] -> [..., O], as products summed over D: the compiler makes it one
    vectorised reduction fused with its neighbours, which for one to a few rows reads the weight faster than an
    external GEMV call does (and never copies a gathered weight)."""
    if x.numel() > SMALL_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    y = (weight * x[..., None, :]).sum(-1)
    return y if bias is None else y + bias


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for small batched factors a [..., M, K], b [..., K, V] as products summed over K (fused, no call)."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)


def _logits(site: _Site, streams: torch.Tensor) -> torch.Tensor:
    """decode._logits: streams [B, N, D] -> scale * (projected, normalised streams) + base [B, (2+N)*N] fp32."""
    flat = _as(streams.reshape(streams.shape[0], -1), torch.float32)
    return _linear(_unit_rms(flat, site.root), site.fn, site.base)


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j x_j in fp32: pre [B, N], streams [B, N, D] -> [B, D] in streams' dtype."""
    return _as((pre[:, :, None] * _as(streams, torch.float32)).sum(1), streams.dtype)


def _mix_step(streams: torch.Tensor, mixer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """decode._mix_step: [comb^T | post] @ [streams; out] -> [B, N, D] in streams' dtype."""
    return _mm(_as(mixer, streams.dtype), torch.cat([streams, _as(out, streams.dtype)[:, None, :]], dim=1))


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A dense or shared-expert MLP (decode_moe._Mlp with _linear; any other module as is)."""
    if isinstance(mlp, _Mlp):
        return _linear(clamped_swiglu_packed(_linear(x, mlp.gate_up), mlp.limit), mlp.down)
    return mlp(x)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as kernels/rms_norm.py (statistics in fp32); the compiler fuses it into one kernel."""
    return weight * _as(F.rms_norm(_as(x, torch.float32), (x.shape[-1],), None, eps), x.dtype)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """kernels/sinkhorn.py on comb [B, N, N]: columns, then (iters - 1) x (rows, columns), each sum + eps."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _pre(site: _Site, norm: tuple, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An mHC site's coefficients, the collapse and the block norm: streams [B, N, D] -> (x [B, D], the mixer
    [B, N, N+1] = [comb^T | post] for _mix_step)."""
    z = _logits(site, streams)  # [B, (2+N)*N] fp32
    B, n = z.shape[0], site.n
    gates = torch.sigmoid(z[:, : 2 * n])
    pre, post = gates[:, :n] + site.eps, 2 * gates[:, n:]
    comb = _sinkhorn(torch.softmax(z[:, 2 * n :].view(B, n, n), dim=-1) + site.eps, site.iters, site.eps)
    mixer = torch.cat([comb.transpose(1, 2), post[:, :, None]], dim=-1)
    return _rms(_collapse(pre, streams), *norm), mixer


def _forget_gate(p: _Kda, f_a: torch.Tensor, rows: int) -> torch.Tensor:
    """KDA's per-channel log decay g [rows, H, K, 1] (fp32) from the gate's low-rank input f_a [rows, r]."""
    raw = (_as(_linear(f_a, p.f_b), torch.float32) + p.dt_bias).view(rows, -1, p.head_dim, 1)
    if p.lower_bound is not None:
        return p.lower_bound * torch.sigmoid(p.rate * raw)
    return p.neg_rate * F.softplus(raw, threshold=20.0)


def _kda(p: _Kda, x: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """decode._kda_step without the cache object: x [B, D] -> out [B, D]; the state [B, H, K, V] and the conv
    history [B, W-1, 3*H*K] advance in place."""
    B, K = x.shape[0], p.head_dim
    qkv_raw, f_a, b, g_a = _linear(x, p.packed[0], p.packed[1]).split(p.packed[2], dim=-1)
    full = torch.cat([conv, qkv_raw[:, None]], dim=1)  # [B, W, 3*H*K]
    qkv = _as(F.silu((_as(full, torch.float32) * p.taps).sum(1)), x.dtype).view(B, 3, -1, 1, K)
    qk = _unit_rms(_as(qkv[:, :2], torch.float32), p.roots[0]) * p.qk_scale  # l2norm (q scaled)
    g = _forget_gate(p, f_a, B)
    dt = state.dtype
    q, k, v = _as(qk[:, 0], dt), _as(qk[:, 1], dt), _as(qkv[:, 2], dt)  # [B, H, 1, K]
    beta = _as(torch.sigmoid(b), dt).view(B, -1, 1, 1)
    S = state * _as(g, dt).exp()
    u = (v - _mm(k, S)) * beta  # [B, H, 1, V]
    S = S + k.transpose(-1, -2) * u
    state.copy_(S)
    o = _as(_mm(q, S), qkv.dtype)  # [B, H, 1, V]
    gate = _as(_linear(g_a, p.g_b), torch.float32).view(B, -1, 1, K)
    of = _unit_rms(_as(o, torch.float32), p.roots[1]) * p.norm_scaled * torch.sigmoid(gate)
    conv.copy_(full[:, 1:])
    return _linear(_as(of, qkv.dtype).view(B, -1), *p.o)


def _moe(p: _Moe, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward for x [B, D]: the router's top-k as tensors, the chosen experts read by index."""
    r = p.router
    if r.n_group > 1:
        _, weights, chosen = r(x)
    else:
        scores = torch.sigmoid(_linear(_as(x, torch.float32), p.router_weight))  # [B, E]
        chosen = (scores + p.router_bias).topk(r.top_k, dim=-1, sorted=False).indices  # [B, k]
        weights = scores.gather(1, chosen)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + NORM_EPS)
        weights = weights * r.routed_scaling_factor
    h = (p.gate_up[chosen] * x[:, None, None, :]).sum(-1)  # [B, k, 2I]: products summed over D, no weight copy
    act = _as(clamped_swiglu_packed(h, p.limit) * weights[..., None], x.dtype)  # [B, k, I]
    routed = (p.down[chosen] * act[:, :, None, :]).sum(-1).sum(1)  # [B, D]
    return _as(routed, x.dtype) + _mlp(p.shared, x)


def _ffn(blk: _Block, streams: torch.Tensor) -> torch.Tensor:
    x, mixer = _pre(blk.ffn_site, blk.post_norm, streams)
    out = _moe(blk.mlp, x) if isinstance(blk.mlp, _Moe) else _mlp(blk.mlp, x)
    return _mix_step(streams, mixer, out)


def _mla_in(p: _Mla, x: torch.Tensor) -> tuple:
    """decode._mla_step's projections: x [B, D] -> (q_resid [B, R], q [B, H, K], latent [B, Z], *x_proj)."""
    B = x.shape[0]
    if p.packed:
        q_a, kv_a, *x_proj = _linear(x, p.packed[0], p.packed[1]).split(p.packed[2], dim=-1)
    else:
        q_a, kv_a, x_proj = _linear(x, *p.q_a), _linear(x, *p.kv_a), []
    q_resid = _rms(q_a, *p.q_a_norm)
    return q_resid, _linear(q_resid, p.q_b).view(B, -1, p.qk_head_dim), _rms(kv_a, *p.kv_norm), *x_proj


# ----------------------------------------------------------------------------------------------------- segments
@dataclass
class _Segment:
    """What one graph runs: an MLA block's second half (`head`), whole KDA blocks, then an MLA block's first half
    (`tail`) or the final norm (tail None). `embed` only in the first segment."""

    head: _Block | None
    kda: list
    tail: _Block | None
    embed: torch.Tensor | None
    norm: tuple
    n: int


def _segment(seg: _Segment, streams: torch.Tensor, head: tuple, mixer: torch.Tensor | None, states: list,
             convs: list) -> tuple:  # fmt: skip
    """streams [B, N, D] (ids [B] in the first segment) -> (streams, *the tail's outputs: the MLA block's x, mixer
    and projections, or the final hidden state); the KDA states and conv histories advance in place. head: the
    head MLA block's attention [B, H, V], or for the absorbed form its inputs (q, the selected latent rows, filled)."""
    return _blocks(seg, streams, head, mixer, lambda i, p, x: _kda(p, x, states[i], convs[i]))


def _blocks(seg: _Segment, streams: torch.Tensor, head: tuple, mixer: torch.Tensor | None, kda) -> tuple:
    """_segment's work on any number of rows (a decode step's B, a verify step's B*T tokens), every KDA block's
    attention run by kda(position among the segment's KDA blocks, its _Kda, x [rows, D]) -> out [rows, D]."""
    if seg.embed is not None:
        x = F.embedding(streams, seg.embed)  # streams: the ids [B]
        streams = x[:, None, :].expand(-1, seg.n, -1).contiguous()
    if seg.head is not None:
        p = seg.head.attention
        attn = _absorbed_attention(p, *head) if len(head) == 3 else head[0]  # [B, H, V]
        streams = _ffn(seg.head, _mix_step(streams, mixer, _linear(attn.reshape(attn.shape[0], -1), *p.o)))
    for i, blk in enumerate(seg.kda):
        x, mix = _pre(blk.attn_site, blk.input_norm, streams)
        out = kda(i, blk.attention, x)
        streams = _ffn(blk, _mix_step(streams, mix, out))
    if seg.tail is None:
        return streams, _rms(streams.mean(dim=1), *seg.norm)
    x, mix = _pre(seg.tail.attn_site, seg.tail.input_norm, streams)
    return (streams, x, mix, *_mla_in(seg.tail.attention, x))


def _segments(plan) -> list[_Segment]:
    """Split the blocks at each MLA block's attention core (decode.py's DecodePlan)."""
    segs, head, kda = [], None, []
    for blk in plan.blocks:
        if isinstance(blk.attention, _Kda):
            kda.append(blk)
            continue
        segs.append(_Segment(head, kda, blk, plan.embed if not segs else None, plan.norm, plan.n))
        head, kda = blk, []
    segs.append(_Segment(head, kda, None, plan.embed if not segs else None, plan.norm, plan.n))
    return segs


def _mla_core(blk: _Block, x, q_resid, q, latent, x_proj, shared) -> tuple[tuple, torch.Tensor]:
    """decode._mla_step after its projections (eager: the cache bookkeeping) -> (the next segment's head: the
    absorbed attention's inputs (q, latent rows [B, J, Z], filled [B, J]) or the per-head attention (out,), top-k)."""
    p, cache = blk.attention, blk.cache
    topk = _cache_token(p, cache, latent, x, q_resid, x_proj, shared)
    if not p.absorb:
        return (_attention(p, q, cache, topk),), topk
    B, cap, Z = cache.latent.shape
    rows = topk.clamp(min=0)  # decode._attention's gather
    if B > 1:
        rows = rows + (torch.arange(B, device=topk.device) * cap)[:, None]
    return (q, cache.rows(rows.flatten()).view(B, -1, Z), topk >= 0), topk


# -------------------------------------------------------------------------------------------------------- runner
class _Recorded:
    """A backend's compiled graph that notes its last call (the flat graph inputs and outputs), so the driver can
    bind a plan's segment to it and call it directly afterwards."""

    last: tuple | None = None

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args):
        out = self.fn(*args)
        _Recorded.last = (self, args, out)
        return out


def _recording(backend: str, cpp_wrapper: bool):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list):
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return _Recorded(compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": cpp_wrapper}))
        return _Recorded(torch._dynamo.lookup_backend(backend)(gm, example_inputs))

    return compile_graph


_COMPILED: dict = {}  # (segment function, backend, cpp_wrapper) -> it compiled


def compiled_segment(backend: str = "inductor", cpp_wrapper: bool = False, fn=_segment):
    """`fn` (_segment; verify_compiled's T-token segment, mtp_compiled's two graphs) compiled by `backend` (one
    function per setting; its graphs are shared by every plan)."""
    key = (fn, backend, cpp_wrapper)
    if key not in _COMPILED:
        _check_backend(backend)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        _COMPILED[key] = torch.compile(fn, backend=_recording(backend, cpp_wrapper), fullgraph=True, dynamic=False)
    return _COMPILED[key]


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


@dataclass
class _Bound:
    """One plan's segment bound to its compiled graph: call() runs the graph without dynamo's guards (the fixed
    inputs are this plan's weights; the step inputs are checked against the layouts the graph was made for)."""

    fn: object  # the backend's compiled graph (unwrapped: a bound call records nothing)
    args: list  # the graph inputs: weights as they are, step inputs as None
    steps: list  # (graph input position, step input position)
    layouts: list  # the step inputs' layouts at binding
    outputs: list  # graph output position of each returned value

    def call(self, inputs: list) -> tuple | None:
        """-> the segment's outputs, or None where a step input's layout differs (then dynamo runs it)."""
        args = self.args
        for (at, i), layout in zip(self.steps, self.layouts):
            if _layout(inputs[i]) != layout:
                return None
            args[at] = inputs[i]
        out = self.fn(*args)
        for at, _ in self.steps:
            args[at] = None
        return tuple(out[j] for j in self.outputs)


def _bind(inputs: list, result: tuple) -> _Bound | None:
    """Bind the graph dynamo just ran (_Recorded.last) from the step inputs and the result by identity; None when
    an output is not one of the graph's (dynamo made it outside the graph)."""
    if _Recorded.last is None:
        return None
    fn, args, out = _Recorded.last
    _Recorded.last = None
    where = {id(t): i for i, t in enumerate(inputs)}
    steps = [(at, where[id(a)]) for at, a in enumerate(args) if id(a) in where]
    fixed = [None if id(a) in where else a for a in args]
    produced = {id(t): j for j, t in enumerate(out)}
    if not all(isinstance(t, torch.Tensor) and id(t) in produced for t in result):
        return None
    return _Bound(fn.fn, fixed, steps, [_layout(inputs[i]) for _, i in steps], [produced[id(t)] for t in result])


# -------------------------------------------------------------------------------------------------------- driver
_OWNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a state or conv buffer made here
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> (its DecodePlan, segments, bindings)


def _owned(cache, name: str) -> torch.Tensor:
    """The layer's state or conv history as a contiguous tensor of its own: the graphs write it in place (the
    prefill's or an eager step's may be a view of a wider tensor, or one a mark() keeps)."""
    t = getattr(cache, name)
    if _OWNED.get(id(t)) is not t:
        t = t.clone(memory_format=torch.contiguous_format)
        setattr(cache, name, t)
        _OWNED[id(t)] = t
    return t


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its strides are not the contiguous ones (a rewind's conv history, a slice of
    a wider tensor): the bound graphs take one layout per input."""
    strides, size = [], 1
    for n in reversed(t.shape):
        strides.insert(0, size)
        size *= n
    return t if t.stride() == tuple(strides) else t.clone(memory_format=torch.contiguous_format)


def _run(kept: list, k: int, compiled, seg: _Segment, streams, head: tuple, mixer, states: list, convs: list):
    """Segment k of a plan: through its bound graph, else through dynamo (then bound for the next steps)."""
    inputs = [streams, mixer, *head, *states, *convs]
    return _call(kept, k, compiled, (seg, streams, head, mixer, states, convs), inputs)


def _call(kept: list, k: int, compiled, args: tuple, inputs: list) -> tuple:
    """compiled(*args) through kept[k], its bound graph, when there is one, else through dynamo (then bound for the
    next calls); inputs: the tensors among args that change from call to call (the rest are the plan's weights)."""
    bound = kept[k]
    if bound is not None:
        out = bound.call(inputs)
        if out is not None:
            return out
    _Recorded.last = None
    result = compiled(*args)
    kept[k] = _bind(inputs, result)
    return result


@torch.inference_mode()
def compiled_decode_step(model, cache: GenerationCache, ids: torch.Tensor, backend: str = "inductor",
                         cpp_wrapper: bool = False) -> torch.Tensor:  # fmt: skip
    """decode_step (same arguments, result and cache effects) with the tensor work compiled by `backend`
    ("inductor"; "aot_eager" traces without code generation). The first call per (config, batch) compiles."""
    check_step_inputs("decode_step", model, cache, ids)
    if cache.marked:
        raise CacheError("decode_step cannot run on a marked cache (rewind() it first)")
    plan = cache.decode_plan
    if plan is None:
        plan = cache.decode_plan = build_plan(model, cache)
    if ids.shape != (plan.batch,):
        raise CacheError(f"decode_step takes ids of shape ({plan.batch},), got {tuple(ids.shape)}")
    kept = _PLANS.get(cache)
    if kept is None or kept[0] is not plan:
        segs = _segments(plan)
        kept = _PLANS[cache] = (plan, segs, [None] * len(segs))
    streams, head, mixer, topk = ids.clone(memory_format=torch.contiguous_format), (), None, None
    compiled = compiled_segment(backend, cpp_wrapper)
    for k, seg in enumerate(kept[1]):
        caches = [blk.cache for blk in seg.kda]
        states, convs = [_owned(c, "state") for c in caches], [_owned(c, "conv") for c in caches]
        streams, *out = _run(kept[2], k, compiled, seg, streams, head, mixer, states, convs)
        for c in caches:
            c.length += 1
        if seg.tail is None:
            return out[0]
        x, mixer, q_resid, q, latent, *x_proj = out
        head, topk = _mla_core(seg.tail, x, q_resid, q, latent, x_proj, topk)
    raise AssertionError("the last segment ends with the final norm")


def _inductor_missing() -> str | None:
    """Why inductor cannot compile on this machine (no torch.compile support, no C++ compiler), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported here"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as err:  # the compiler search raises when none is found
        return f"no C++ compiler for inductor ({err})"
    return None if shutil.which(compiler) else f"no C++ compiler for inductor ({compiler} not found)"


def compile_setting(compile: bool | str) -> dict | None:
    """generate's `compile` option -> the compiled steps' backend keywords, or None to run eagerly: False None;
    True inductor with its C++ wrapper (None where torch.compile is unsupported, with a warning); a backend name
    (e.g. "aot_eager") that backend."""
    if compile is False:
        return None
    if compile is True:
        missing = _inductor_missing()
        if missing:
            warnings.warn(f"generate(compile=True): {missing}; decoding eagerly")
            return None
        return dict(backend="inductor", cpp_wrapper=True)
    _check_backend(compile, "compile must be True, False or")
    return dict(backend=compile)


def step_function(compile: bool | str):
    """generate's `compile` option -> the decode step it runs: decode_step, or compiled_decode_step with the
    backend of compile_setting."""
    setting = compile_setting(compile)
    return decode_step if setting is None else functools.partial(compiled_decode_step, **setting)


def _check_backend(backend, what: str = "backend must be") -> None:
    """A GenerationError naming the choices unless `backend` is a torch.compile backend name."""
    names = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in names:
        raise GenerationError(f"{what} a torch.compile backend name ({', '.join(names)}), got {backend!r}")


__all__ = ["compile_setting", "compiled_decode_step", "compiled_segment", "step_function"]
