"""mHC mix: spread a block's output over the streams and mix the residual streams (one site's output).

Legend: B batch, T time, N streams, D model width.
streams [B, T, N, D]; comb [B, T, N, N] and post [B, T, N] (fp32 coefficients); out [B, T, D] the block's output.
Returns  new_i = post_i * out + sum_j comb_ji * streams_j   [B, T, N, D], computed in streams' dtype
(transformers' Glm5NextTextDecoderLayer: the coefficients are cast to the streams' dtype first).
"""

from __future__ import annotations

import torch

from .dispatch import register
from .function import apply


def hc_mix_reference(streams: torch.Tensor, comb: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    mixed = torch.einsum("btji,btjd->btid", comb.to(streams.dtype), streams)
    return post.to(streams.dtype)[..., None] * out[:, :, None, :] + mixed


class _HcMix(torch.autograd.Function):
    """One batched matmul plus one in-place multiply-add forward; four batched matmuls backward.

    Autograd on the reference keeps the outer product post x out as a separate [B, T, N, D] tensor, adds it in a
    second pass, and reduces its gradient with broadcast multiplies and sums; here every contraction over N or D
    is a batched matmul over the B*T tokens and nothing [B, T, N, D]-sized is formed besides the result.
    """

    @staticmethod
    def forward(ctx, streams, comb, post, out):
        B, T, N, D = streams.shape
        x = streams.reshape(B * T, N, D)
        c = comb.to(streams.dtype).reshape(B * T, N, N)
        p = post.to(streams.dtype).reshape(B * T, N, 1)
        y = out.to(streams.dtype).reshape(B * T, 1, D)
        # written into a base tensor of the output's shape: a view as a module's output trips FSDP2's pre-backward
        # hook check ("returned a view tensor")
        new = streams.new_empty(B, T, N, D)
        torch.bmm(c.transpose(1, 2), x, out=new.view(B * T, N, D)).addcmul_(p, y)
        ctx.save_for_backward(x, c, p, y)
        ctx.dtypes = (comb.dtype, post.dtype, out.dtype)
        return new

    @staticmethod
    def backward(ctx, grad):
        x, c, p, y = ctx.saved_tensors
        B, T, N, D = grad.shape
        g = grad.reshape(B * T, N, D)
        comb_dtype, post_dtype, out_dtype = ctx.dtypes
        d_streams = d_comb = d_post = d_out = None
        if ctx.needs_input_grad[0]:
            # d x_j = sum_i comb_ji g_i, written into a base tensor (not a view): autograd can then add the streams'
            # other gradients (collapse, projection) into it in place instead of allocating a sum
            d_streams = grad.new_empty(B, T, N, D)
            torch.bmm(c, g, out=d_streams.view(B * T, N, D))
        if ctx.needs_input_grad[1]:
            d_comb = torch.bmm(x, g.transpose(1, 2)).view(B, T, N, N).to(comb_dtype)  # d comb_ji = x_j . g_i
        if ctx.needs_input_grad[2]:
            d_post = torch.bmm(g, y.transpose(1, 2)).view(B, T, N).to(post_dtype)  # d post_i = g_i . out
        if ctx.needs_input_grad[3]:
            d_out = torch.bmm(p.transpose(1, 2), g).view(B, T, D).to(out_dtype)  # d out = sum_i post_i g_i
        return d_streams, d_comb, d_post, d_out


def hc_mix(streams: torch.Tensor, comb: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Same result as hc_mix_reference; batched-matmul forward and hand-written backward."""
    return apply(_HcMix, streams, comb, post, out)


register("hc_mix", "reference", hc_mix_reference)
register("hc_mix", "fast", hc_mix)
