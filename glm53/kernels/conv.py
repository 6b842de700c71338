"""Causal depthwise 1-D convolution (the short conv on KDA's q, k and v).

Legend: B batch, T time, W kernel width; the channels are H*K (one of KDA's q, k, v projections; the code's
locals call the channel count D).
x: [B, T, H*K]; weight: [H*K, W] (tap W-1 multiplies the current token); optional state: [B, H*K, W-1], the
last W-1 inputs before x (zeros when absent). Returns y [B, T, H*K] in fp32 and, if asked, the new state
[B, H*K, W-1] (the last W-1 inputs of cat(state, x)), in x's dtype. No bias, no activation: the caller applies them.
"""

from __future__ import annotations

import torch

from .dispatch import register


def _history(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """Validated history [B, H*K, W-1] in x's dtype (zeros without a state)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected ({D}, W)")
    if initial_state is None:
        return x.new_zeros(B, D, W - 1)
    if initial_state.shape != (B, D, W - 1):
        raise ValueError(f"conv state has shape {tuple(initial_state.shape)}, expected {(B, D, W - 1)}")
    return initial_state.to(x.dtype)


def _with_history(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    return torch.cat([_history(x, weight, initial_state), x.transpose(1, 2)], dim=-1)  # [B, H*K, W-1+T]


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


class _CausalConv1d(torch.autograd.Function):
    """W shifted multiply-adds in the [B, T, H*K] layout, forward and hand-written backward.

    CPU autograd of a depthwise F.conv1d spends several times the forward in convolution_backward; here the
    backward is W more shifted multiply-adds for the input (and the history) and W products reduced over (B, T)
    for the weight. full = cat(history, x) along time [B, W-1+T, H*K] in fp32 is the one tensor kept.
    """

    @staticmethod
    def forward(ctx, x, weight, history):
        T, W = x.shape[1], weight.shape[-1]
        full = torch.cat([history.float(), x.float()], dim=1)  # [B, W-1+T, H*K]
        w = weight.float()
        y = full[:, :T] * w[:, 0]
        for tap in range(1, W):
            y.addcmul_(full[:, tap : tap + T], w[:, tap])
        ctx.save_for_backward(full, weight)
        ctx.dtypes = (x.dtype, history.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        full, weight = ctx.saved_tensors
        T, W = dy.shape[1], weight.shape[-1]
        dy, w = dy.float(), weight.float()
        d_full = full.new_zeros(full.shape)
        for tap in range(W):
            d_full[:, tap : tap + T].addcmul_(dy, w[:, tap])
        d_weight = torch.stack([(dy * full[:, tap : tap + T]).sum(dim=(0, 1)) for tap in range(W)], dim=-1)
        x_dtype, history_dtype = ctx.dtypes
        return d_full[:, W - 1 :].to(x_dtype), d_weight.to(weight.dtype), d_full[:, : W - 1].to(history_dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same sum as shifted multiply-adds in the [B, T, H*K] layout, with a hand-written backward."""
    history = _history(x, weight, initial_state).transpose(1, 2)  # [B, W-1, H*K]
    y = _CausalConv1d.apply(x, weight, history)  # [B, T, H*K] fp32
    if not output_final_state:
        return y, None
    recent = torch.cat([history, x], dim=1)[:, x.shape[1] :]  # the last W-1 inputs [B, W-1, H*K]
    return y, recent.transpose(1, 2)


register("causal_conv1d", "reference", causal_conv1d_reference)
register("causal_conv1d", "fast", causal_conv1d)
