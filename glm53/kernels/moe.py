"""Routed experts: each token's hidden state goes through its top-k experts' clamped SwiGLU, weighted.

Legend: N tokens, H hidden width, I expert width, E experts, k experts per token.
x: [N, H]; topk_idx: [N, k] int; topk_weight: [N, k]; gate_up: [E, 2I, H] (gate rows first, then up);
down: [E, H, I]. Returns [N, H] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): GLM-5.3's SwiGLU everywhere."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def moe_experts_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """One expert at a time over the tokens routed to it (the per-expert loop)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, limit), down[e]) * topk_weight[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


register("moe_experts", "reference", moe_experts_reference)
