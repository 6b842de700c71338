"""mHC collapse: the block input sum_j pre_j * x_j, products and sum in fp32 (transformers' HyperConnection).

Legend: B batch, T time, N streams, D model width.
pre: [B, T, N] fp32; streams: [B, T, N, D] (any float dtype). Returns [B, T, D] in streams' dtype.
"""

from __future__ import annotations

import torch

from .dispatch import register
from .function import apply


def hc_collapse_reference(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Upcast and contract; autograd keeps the fp32 copy of the streams for pre's gradient."""
    return torch.einsum("btn,btnd->btd", pre.float(), streams.float()).to(streams.dtype)


class _HcCollapse(torch.autograd.Function):
    """Saves the streams in their own dtype and upcasts again in backward: no fp32 copy outlives the forward."""

    @staticmethod
    def forward(ctx, pre, streams):
        ctx.save_for_backward(pre, streams)
        # [B, T, 1, N] @ [B, T, N, D]: one batched matmul (einsum's parsing and permutes cost ~3x at a decode step)
        return torch.matmul(pre.float()[..., None, :], streams.float()).squeeze(-2).to(streams.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, streams = ctx.saved_tensors
        grad = grad.float()
        d_pre = torch.einsum("btd,btnd->btn", grad, streams.float()) if ctx.needs_input_grad[0] else None
        d_streams = (
            (pre.float()[..., None] * grad[:, :, None, :]).to(streams.dtype) if ctx.needs_input_grad[1] else None
        )
        return (None if d_pre is None else d_pre.to(pre.dtype)), d_streams


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Same result; backward recomputes the upcast instead of storing it (a no-op cost for fp32 streams)."""
    return apply(_HcCollapse, pre, streams)


register("hc_collapse", "reference", hc_collapse_reference)
register("hc_collapse", "fast", hc_collapse)
