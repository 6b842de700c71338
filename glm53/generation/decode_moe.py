"""The decode step's feed-forward parts: MoE for a few tokens (one GEMV pair per chosen expert) and the MLPs with
packed gate | up weights. decode.py's block step calls them; verify.py's T-token step calls _moe_step too.

Legend (glm53/model/__init__.py): B batch, D model width, E routed experts, I expert width, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundary import as_local
from ..kernels.moe import clamped_swiglu_packed
from ..model.moe import NORM_EPS
from .decode_common import _as, _derived


@dataclass
class _Mlp:
    """A (shared-expert or dense) MLP with its gate and up projections packed into one [2I, D] weight."""

    gate_up: torch.Tensor  # [2I, D]
    down: torch.Tensor  # [D, I]
    limit: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(clamped_swiglu_packed(F.linear(x, self.gate_up), self.limit), self.down)


def _mlp(mlp: nn.Module) -> _Mlp | nn.Module:
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "swiglu_limit")):
        return mlp  # not the plain MLP: called as is
    gate, up = as_local(mlp.gate_proj, "weight"), as_local(mlp.up_proj, "weight")
    packed = _derived(mlp, "gate_up", [gate, up], lambda: torch.cat([gate, up]))
    return _Mlp(packed, as_local(mlp.down_proj, "weight"), mlp.swiglu_limit)


@dataclass
class _Moe:
    """MoE's router, expert weights and shared expert for a decode step."""

    router: nn.Module  # Router, called as is (or inlined for one token: _route_token)
    gate_up: torch.Tensor  # [E, 2I, D]
    down: torch.Tensor  # [E, D, I]
    limit: float
    shared: _Mlp | nn.Module  # the shared expert ([B, D] in and out)
    gate_up_e: list  # E views [2I, D]: an expert's weight without a dispatched select per step
    down_t_e: list  # E views [I, D]: down[e].t()
    router_weight: torch.Tensor  # [E, D] fp32
    router_bias: torch.Tensor  # [E] fp32 e_score_correction_bias


def _moe(moe: nn.Module) -> _Moe:
    experts, router = moe.experts, moe.gate
    gate_up, down = as_local(experts, "gate_up_proj"), as_local(experts, "down_proj")
    return _Moe(router, gate_up, down, experts.swiglu_limit, _mlp(moe.shared_experts), list(gate_up.unbind(0)),
                [d.t() for d in down.unbind(0)], as_local(router, "weight").float(),
                router.e_score_correction_bias.float())  # fmt: skip


def _route_token(p: _Moe, x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Router.forward for one token x [1, D] without groups -> (the chosen experts in visiting order: sorted,
    their routing weights [k, 1] fp32 in that order). The choice is the tensor top-k (as Router's); the k chosen
    scores are renormalised on the host (fp64 scalars: equal up to fp32 rounding)."""
    r = p.router
    scores = torch.sigmoid(F.linear(_as(x, torch.float32), p.router_weight))  # [1, E]
    chosen = (scores + p.router_bias).topk(r.top_k, dim=-1, sorted=False).indices
    experts = chosen[0].tolist()  # NOTE: syncs (the chosen experts steer the host loop)
    values = scores[0, experts].tolist()
    if r.norm_topk_prob:
        total = sum(values) + NORM_EPS
        values = [v / total for v in values]
    pairs = sorted(zip(experts, values), key=lambda pair: pair[0])
    weights = torch.tensor([[v * r.routed_scaling_factor] for _, v in pairs], dtype=torch.float32, device=x.device)
    return [e for e, _ in pairs], weights


def _moe_step(p: _Moe, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward for a few tokens x [B, D]: one GEMV pair per chosen expert instead of the grouped kernel's
    sort-and-scatter over all E experts. Pairs are visited and summed in moe_experts_grouped's order (sorted by
    expert, stable), so each token's expert outputs are added in the same order."""
    if x.shape[0] == 1 and p.router.n_group <= 1:
        chosen, weights = _route_token(p, x)
        return _moe_token(p, x, weights, chosen)
    _, weights, indices = p.router(x)  # [B, k] fp32, [B, k]
    k = indices.shape[1]
    experts = indices.flatten().tolist()  # NOTE: syncs (the chosen experts steer the host loop)
    order = sorted(range(len(experts)), key=experts.__getitem__)
    if x.shape[0] == 1:
        return _moe_token(p, x, weights[0, order][:, None], [experts[i] for i in order])
    pair_weights = weights.flatten()[order][:, None]  # [B*k, 1] in visiting order
    ys, i = [], 0
    while i < len(order):
        e, j = experts[order[i]], i
        while j < len(order) and experts[order[j]] == e:
            j += 1
        act = clamped_swiglu_packed(F.linear(x[[pair // k for pair in order[i:j]]], p.gate_up[e]), p.limit)
        ys.append(F.linear(_as(act * pair_weights[i:j], x.dtype), p.down[e]))
        i = j
    token = torch.tensor([pair // k for pair in order], device=x.device)
    routed = torch.zeros_like(x).index_add(0, token, torch.cat(ys).to(x.dtype))
    return routed + p.shared(x)


def _moe_token(p: _Moe, x: torch.Tensor, weights: torch.Tensor, chosen: list[int]) -> torch.Tensor:
    """_moe_step for one token x [1, D] and its k distinct experts in visiting order (weights [k, 1] fp32): the
    k gate/up GEMVs side by side so the SwiGLU and the routing weights are one op each, then the down GEMVs
    accumulated in order (addmm: each adds its product to the running sum, as the sum of separate outputs)."""
    h = torch.cat([F.linear(x, p.gate_up_e[e]) for e in chosen])  # [k, 2I]
    act = _as(clamped_swiglu_packed(h, p.limit) * weights, x.dtype).split(1)  # k x [1, I]
    routed = torch.mm(act[0], p.down_t_e[chosen[0]])
    for i in range(1, len(chosen)):
        routed = torch.addmm(routed, act[i], p.down_t_e[chosen[i]])
    return routed + p.shared(x)


__all__ = ["_Mlp", "_Moe", "_mlp", "_moe", "_moe_step", "_moe_token"]
