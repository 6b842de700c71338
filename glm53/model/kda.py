"""Kimi Delta Attention layer (KDA): GLM-5.3's linear-attention block.

Legend: B batch, T time, D model width, H heads, K head width (values share it: V = K), W conv width.
Following transformers' Glm5NextTextLinearAttention:
    x = x * padding_mask                                     (padding never enters the state)
    q, k, v = silu(causal_conv(proj(x)))                     (three separate depthwise convs, fp32)
    g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))   or  -exp(A_log) * softplus(...) if no bound
    beta = sigmoid(b_proj(x))
    o = KDA(l2norm(q), l2norm(k), v, g, beta)                (kernels/kda/chunk.py)
    out = o_proj(gated_rmsnorm(o, g_b(g_a(x))))
Packed documents (ctx.cu_seqlens): the convs and the KDA state restart at every document start.
Context parallelism (ctx.cp, model/cp.py): the convs read the previous rank's last W - 1 inputs (a halo) and the
state enters from the ranks before through their transitions (kernels/kda/state_passing.py, `kda_sharded`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Glm53Config
from ..hooks import as_local
from ..kernels import kernel_op
from ..kernels.kda import l2norm
from ..kernels.kda.state_passing import kda_sharded
from .context import ForwardContext
from .cp import halo_starts
from .norm import GatedRMSNorm
from .packing import starts_to_cu_seqlens

# kernels resolved once; use_backend keeps them current (kernels/dispatch.py)
causal_conv1d, kda, kda_recurrent = kernel_op("causal_conv1d"), kernel_op("kda"), kernel_op("kda_recurrent")

L2NORM_EPS = 1e-6  # fla's l2norm epsilon
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) == x above this (transformers' overflow guard)
# fla's initialisation of the decay parameters (transformers' _init_weights for the forget gate)
A_INIT_RANGE = (1.0, 16.0)
DT_INIT_RANGE = (1e-3, 1e-1)
DT_INIT_FLOOR = 1e-4


class CausalConv1d(nn.Module):
    """Depthwise causal conv weights, stored as the checkpoint stores them: weight [C, 1, W], no bias."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, C] -> silu(conv(x)) [B, T, C], computed in fp32 and cast back to x's dtype."""
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}  # kernel keyword, only when packed
        y, _ = causal_conv1d(x, as_local(self, "weight")[:, 0, :], initial_state=state, **packed)
        return F.silu(y).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: Glm53Config) -> None:
        super().__init__()
        D, H, K = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.head_dim = K
        self.lower_bound = config.linear_lower_bound
        self.initializer_range = config.initializer_range
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = CausalConv1d(H * K, config.linear_conv_kernel_dim)
        self.k_conv1d = CausalConv1d(H * K, config.linear_conv_kernel_dim)
        self.v_conv1d = CausalConv1d(H * K, config.linear_conv_kernel_dim)
        # forget gate: low-rank projection, per-channel bias, per-head rate
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.A_log = nn.Parameter(torch.empty(H))
        self.b_proj = nn.Linear(D, H, bias=False)
        # output gate and norm
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = GatedRMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> g [B, T, H, K], fp32 log-space decay (<= 0)."""
        raw = self.f_b_proj(self.f_a_proj(x)).float() + as_local(self, "dt_bias").float()
        raw = raw.unflatten(-1, (-1, self.head_dim))  # [B, T, H, K]
        rate = as_local(self, "A_log").float().exp()[:, None]  # [H, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * raw)
        # F.softplus switches to x above the threshold without evaluating exp(x) there, so its gradient stays
        # finite for any input (a where() over log1p(exp(x)) overflows in the unused branch: 0 * inf = NaN).
        return -rate * F.softplus(raw, threshold=SOFTPLUS_THRESHOLD)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; padded positions (ctx.valid False) are zeroed before the layer.

        With a generation cache (ctx.cache, model/cache.py) the convs and the state continue the cached ones, and
        both are stored back: the prefill takes the chunked kernel, later forwards the recurrent one
        (kernels/kda/recurrent.py), which keeps each token's state while the cache is marked for speculation."""
        if ctx is not None:
            x = (x * ctx.valid[:, :, None]).to(x.dtype)
        split = lambda t: t.unflatten(-1, (-1, self.head_dim))  # noqa: E731  [B, T, H*K] -> [B, T, H, K]
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if ctx is not None and ctx.cp is not None:
            return self._sharded(x, ctx, [split(t) for t in self._sharded_convs(projected, ctx)], split)
        cache = None if ctx is None or ctx.cache is None else ctx.cache.layer(self)
        cu_seqlens = None if ctx is None else ctx.cu_seqlens
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}  # kernel keyword, only when packed
        if cache is None:
            q, k, v = (split(conv(t, cu_seqlens=cu_seqlens)) for conv, t in zip(convs, projected))
        else:
            q, k, v = (split(conv(t, state=history)) for conv, t, history in zip(convs, projected, cache.conv))
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        q, k = l2norm(q.float(), L2NORM_EPS), l2norm(k.float(), L2NORM_EPS)
        if cache is not None:
            o = self._cached_rule(q, k, v, g, beta, projected, ctx.cache, cache)
        else:  # q, k stay fp32 (fla l2-normalises inside its fp32 kernel); g >= lower_bound: no host sync
            o, _ = kda(q, k, v, g, beta, gate_floor=self.lower_bound, **packed)
        return self._output(x, o.to(v.dtype), split)

    def _cached_rule(self, q, k, v, g, beta, projected: list[torch.Tensor], generation, cache) -> torch.Tensor:
        """The delta rule from the cached state; stores the new state and conv histories (and, while marked, every
        token's, for rewind) -> o [B, T, H, V]."""
        T = q.shape[1]
        width = cache.conv[0].shape[-1]
        inputs = [torch.cat([h, p.transpose(1, 2).to(h.dtype)], dim=-1) for h, p in zip(cache.conv, projected)]
        if not generation.started:  # the prefill: the chunked kernel from an empty state
            o, S = kda(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
            cache.state.copy_(S)
        else:  # a few tokens: the recurrent kernel, every state kept
            o, states = kda_recurrent(q, k, v, g, beta, initial_state=cache.state)  # [B, T, H, K, V]
            cache.state.copy_(states[:, -1])
            if generation.marked:
                cache.steps[2].index_copy_(1, generation.step_offset(T), states)
        for conv, seen in zip(cache.conv, inputs):
            conv.copy_(seen[..., seen.shape[-1] - width :])  # the last W - 1 inputs
        if generation.marked:  # each conv's history after every new token [B, T, C, W-1]
            for buf, seen in zip(cache.steps[3], inputs):
                buf.index_copy_(1, generation.step_offset(T), seen.unfold(-1, width, 1)[:, :, 1:].transpose(1, 2))
        return o

    def _output(self, x: torch.Tensor, o: torch.Tensor, split) -> torch.Tensor:
        """o [B, T, H, K] -> o_proj(gated_rmsnorm(o, g_b(g_a(x)))) [B, T, D]."""
        gate = split(self.g_b_proj(self.g_a_proj(x)))
        o = self.o_norm(o, gate)  # [B, T, H, K]
        return self.o_proj(o.flatten(-2))  # [B, T, H*K]

    def _sharded_convs(self, projected: list[torch.Tensor], ctx: ForwardContext) -> list[torch.Tensor]:
        """The three convs on this rank's slice, each extended by the previous rank's last W - 1 inputs (one
        exchange for all three); packed, a tap never reads across a document start, halo included."""
        width = self.q_conv1d.weight.shape[-1] - 1
        halo = ctx.cp.from_previous(torch.cat(projected, dim=-1), width)  # [B, W - 1, 3 * H * K] (zeros on rank 0)
        halos = halo.split([t.shape[-1] for t in projected], dim=-1)
        cu = None if ctx.segment_ids is None else starts_to_cu_seqlens(halo_starts(ctx.segment_ids, ctx.cp, width))
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return [conv(torch.cat([h, t], dim=1), cu_seqlens=cu)[:, width:] for conv, h, t in zip(convs, halos, projected)]

    def _sharded(self, x: torch.Tensor, ctx: ForwardContext, qkv: list[torch.Tensor], split) -> torch.Tensor:
        """The delta rule on this rank's slice, its initial state composed from the earlier ranks' transitions."""
        q, k, v = qkv
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        q, k = l2norm(q.float(), L2NORM_EPS), l2norm(k.float(), L2NORM_EPS)
        packed = {}
        if ctx.segment_ids is not None:
            starts = halo_starts(ctx.segment_ids, ctx.cp, 0)  # [B, T]
            packed = dict(starts=starts, cu_seqlens=starts_to_cu_seqlens(starts))
        bounded = functools.partial(kda, gate_floor=self.lower_bound)  # g >= lower_bound: no host sync
        o = kda_sharded(q, k, v, g, beta, ctx.cp, kernel=bounded, **packed)
        return self._output(x, o.to(v.dtype), split)

    def init_weights(self) -> None:
        std = self.initializer_range
        for linear in (
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.f_a_proj,
            self.f_b_proj,
            self.b_proj,
            self.g_a_proj,
            self.g_b_proj,
            self.o_proj,
        ):
            nn.init.normal_(linear.weight, std=std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            nn.init.normal_(conv.weight, std=std)
        with torch.no_grad():
            if self.lower_bound is not None:
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE).log())
            log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(DT_INIT_RANGE[0]), math.log(DT_INIT_RANGE[1]))
            dt = log_dt.exp().clamp_min(DT_INIT_FLOOR)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm.init_weights()
