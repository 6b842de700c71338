"""Aux-loss-free expert balancing (DeepSeek-V3 section 2.1.2): count expert loads, then move the router biases.

Legend (glm53/model/__init__.py): B batch, T time, M tokens (B * T), E routed experts, k experts per token.
A training-mode forward adds each router's tokens-per-expert to `Router.counted_load` (`count_expert_loads`, like
a BatchNorm's running statistics: a side effect of model.train()); after optimizer.step() `update_router_bias`
moves every bias by rate * sign(mean load - load) and clears the counts. Neither is a loss: no gradient flows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from .context import LayerStats
from .moe import Router


def expert_load(indices: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [E] (fp32), padding excluded. indices [M, k], valid [B, T]."""
    hits = valid.flatten()[:, None].expand_as(indices).float()
    load = torch.zeros(num_experts, device=indices.device)
    return load.scatter_add_(0, indices.flatten(), hits.flatten())


@torch.no_grad()
def count_expert_loads(routed: Iterable[tuple[Router, LayerStats, torch.Tensor]]) -> None:
    """Add this forward's tokens-per-expert to `router.counted_load` for each (router, its layer's stats, valid)."""
    for router, stats, valid in routed:
        load = expert_load(stats.router_indices, valid, router.num_experts)
        router.counted_load = load if router.counted_load is None else router.counted_load + load


@torch.no_grad()
def update_router_bias(
    routers: list[Router],
    required: list[Router],
    rate: float,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """bias_i += rate * sign(mean load - load_i) for every router with counted loads, then clear the counts.

    `required`: the routers a training forward always counts (the main model's; MTP routers count only in forwards
    that ran MTP): without their counts there is nothing to balance. `reduce` sums the stacked loads [routers, E]
    over data-parallel ranks (the parallel layer supplies it; model code holds no collectives).
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
        # a NaN rate turned every bias into NaN; a negative one pushed load toward the busiest experts
        raise ValueError(f"update_router_bias: rate must be a finite number >= 0, got {rate!r}")
    if not routers:
        return
    if any(r.counted_load is None for r in required):
        raise RuntimeError(
            "update_router_bias needs the expert loads of a training forward "
            "(model.train()) since the last update; none were counted"
        )
    counted = [r for r in routers if r.counted_load is not None]
    loads = torch.stack([r.counted_load for r in counted])  # [layers, E]
    if reduce is not None:
        loads = reduce(loads)
    for router, load in zip(counted, loads):
        router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        router.counted_load = None


__all__ = ["count_expert_loads", "expert_load", "update_router_bias"]
