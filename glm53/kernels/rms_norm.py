"""RMS normalisation, plain and gated (KDA's output norm), with hand-written backwards.

Legend: ... any leading dims, d the normalised width (D in the block norms, R and Z in MLA's latent norms, V in
KDA's per-head gated norm). x: [..., d]; weight: [d]; gate: [..., d].
    rms_norm(x, w)          = w * (x * r).to(x.dtype),                  r = rsqrt(mean(x^2) + eps) in fp32
    gated_rms_norm(x, g, w) = (x * r * w * sigmoid(g)).to(x.dtype),     everything in fp32
(transformers' Glm5NextTextRMSNorm casts the normalised x back before the weight; the KDA gated norm does not).
"""

from __future__ import annotations

import torch

from .dispatch import register
from .function import apply


def _rsqrt_mean_square(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x [..., d] -> [..., 1] 1 / sqrt(mean(x^2) + eps)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * _rsqrt_mean_square(xf, eps)).to(x.dtype)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * _rsqrt_mean_square(xf, eps) * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def _normalize_backward(dn: torch.Tensor, n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Gradient through n = x r, r = rsqrt(mean(x^2) + eps), given n itself (fp32):
    dx = r (dn - n mean(dn n))   (x r^2 mean(dn x) = n mean(dn n))."""
    return torch.addcmul(dn, n, (dn * n).mean(-1, keepdim=True), value=-1).mul_(r)


def _sum_leading(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [d]: a weight's gradient summed over every leading dim."""
    return x.reshape(-1, x.shape[-1]).sum(0)


class _RmsNorm(torch.autograd.Function):
    """Saves x and the [..., 1] scale only (autograd through the formula keeps x^2, the normalised x, ...)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = _rsqrt_mean_square(xf, eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        n = x.float() * r
        d_x = d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = _sum_leading(grad * n.to(x.dtype)).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            d_x = _normalize_backward(grad.float() * weight.float(), n, r).to(x.dtype)
        return d_x, d_weight, None


class _GatedRmsNorm(torch.autograd.Function):
    """Saves x, the gate and the [..., 1] scale; the sigmoid and the products are recomputed in backward."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        xf = x.float()
        r = _rsqrt_mean_square(xf, eps)
        ctx.save_for_backward(x, gate, weight, r)
        return (xf * r * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, gate, weight, r = ctx.saved_tensors
        n = x.float() * r
        s = torch.sigmoid(gate.float())
        g = grad.float()
        d_x = d_gate = d_weight = None
        if ctx.needs_input_grad[2]:
            d_weight = _sum_leading(g * s * n).to(weight.dtype)
        gw = g * weight.float()
        if ctx.needs_input_grad[1]:  # d gate = grad w n s (1 - s)
            d_gate = torch.ops.aten.sigmoid_backward(gw * n, s).to(gate.dtype)
        if ctx.needs_input_grad[0]:
            d_x = _normalize_backward(gw.mul_(s), n, r).to(x.dtype)
        return d_x, d_gate, d_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same result as rms_norm_reference; hand-written backward."""
    return apply(_RmsNorm, x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same result as gated_rms_norm_reference; hand-written backward."""
    return apply(_GatedRmsNorm, x, gate, weight, eps)


register("rms_norm", "reference", rms_norm_reference)
register("rms_norm", "fast", rms_norm)
register("gated_rms_norm", "reference", gated_rms_norm_reference)
register("gated_rms_norm", "fast", gated_rms_norm)
