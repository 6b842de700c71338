"""Causal depthwise 1-D convolution (the short conv on KDA's q, k and v).

Legend: B batch, T time, D channels, W kernel width.
x: [B, T, D]; weight: [D, W] (tap W-1 multiplies the current token); optional state: [B, D, W-1], the last
W-1 inputs before x (zeros when absent). Returns y [B, T, D] in fp32 and, if asked, the new state
[B, D, W-1] (the last W-1 inputs of cat(state, x)), in x's dtype. No bias, no activation: the caller applies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register


def _with_history(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected ({D}, W)")
    if initial_state is None:
        history = x.new_zeros(B, D, W - 1)
    else:
        if initial_state.shape != (B, D, W - 1):
            raise ValueError(f"conv state has shape {tuple(initial_state.shape)}, expected {(B, D, W - 1)}")
        history = initial_state.to(x.dtype)
    return torch.cat([history, x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y_t = sum_w weight[:, w] * x_{t - (W-1) + w}, tap by tap."""
    T, W = x.shape[1], weight.shape[-1]
    full = _with_history(x, weight, initial_state)
    y = sum(weight[:, w, None].float() * full[:, :, w : w + T].float() for w in range(W))
    state = full[:, :, full.shape[-1] - (W - 1) :] if output_final_state else None
    return y.transpose(1, 2), state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same with one grouped F.conv1d (what transformers' causal_conv1d_fn computes)."""
    D, W = weight.shape
    full = _with_history(x, weight, initial_state)
    y = F.conv1d(full.float(), weight.float()[:, None, :], groups=D)  # [B, D, T]
    state = full[:, :, full.shape[-1] - (W - 1) :] if output_final_state else None
    return y.transpose(1, 2), state


register("causal_conv1d", "reference", causal_conv1d_reference)
register("causal_conv1d", "eager", causal_conv1d)
