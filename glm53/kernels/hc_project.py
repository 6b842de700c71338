"""mHC coefficient projection: RMSNorm (no weight) of the flattened streams, then the fp32 projection `fn`.

Legend: M tokens (any leading dims, flattened), N streams, D model width; N*D is the flattened stream width
(the code's K) and (2+N)*N the number of coefficients.
flat [..., N*D] fp32, fn [(2+N)*N, N*D] fp32 -> [..., (2+N)*N] = (flat @ fn^T) * rsqrt(mean(flat^2) + eps).
The per-token scale commutes with the projection, so the normalised [..., N*D] copy is never formed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register
from .function import apply


def hc_project_reference(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    normed = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + eps)
    return F.linear(normed, fn)


class _HcProject(torch.autograd.Function):
    """Forward: one GEMM and one row norm; backward: two GEMMs and one multiply-add over [M, N*D].

    With r = rsqrt(mean(flat^2) + eps), raw = flat @ fn^T and result = raw * r:
        d raw = d result * r,   d r = sum_e d result_e raw_e,   d flat = d raw @ fn - (d r * r^3 / (N*D)) flat.
    Autograd through a norm would instead run a division, a masked fill and two broadcast passes over [M, N*D].
    """

    @staticmethod
    def forward(ctx, flat, fn, eps):
        K = flat.shape[-1]
        f = flat.reshape(-1, K)
        raw = torch.mm(f, fn.t())  # [M, (2+N)*N]
        r = torch.rsqrt(torch.linalg.vector_norm(f, dim=-1, keepdim=True).square_() / K + eps)  # [M, 1]
        ctx.save_for_backward(f, fn, raw, r)
        return (raw * r).view(*flat.shape[:-1], fn.shape[0])

    @staticmethod
    def backward(ctx, grad):
        f, fn, raw, r = ctx.saved_tensors
        K = f.shape[-1]
        g = grad.reshape(raw.shape)
        d_raw = g * r
        coef = (g * raw).sum(dim=-1, keepdim=True) * r.pow(3) / -K  # [M, 1]
        d_flat = torch.mm(d_raw, fn).addcmul_(f, coef).view(*grad.shape[:-1], K) if ctx.needs_input_grad[0] else None
        # contiguous first: MKL is slow on this thin [(2+N)*N, M] x [M, N*D] product with a transposed view
        d_fn = torch.mm(d_raw.t().contiguous(), f) if ctx.needs_input_grad[1] else None
        return d_flat, d_fn, None


def hc_project(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Same result as hc_project_reference; hand-written backward."""
    return apply(_HcProject, flat, fn, eps)


register("hc_project", "reference", hc_project_reference)
register("hc_project", "fast", hc_project)
