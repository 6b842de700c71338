"""sinkhorn_scaling (the row / column scaling form of Sinkhorn, kernels/sinkhorn.py) and sinkhorn4_host (the same
iterations as Python scalars for 4 x 4 matrices) against sinkhorn_reference.

Legend: N streams; x [..., N, N] positive (softmax + eps, as mHC feeds it).
Peaked inputs (softmax of logits with std 6) are far from doubly stochastic, so every iteration still moves the
matrix: a step in the wrong order, a missing step or a misplaced eps shows well above fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.sinkhorn import sinkhorn4_host, sinkhorn_reference, sinkhorn_scaling

EPS = 1e-6


def _peaked(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(6 * torch.randn(*shape, generator=gen), dim=-1) + EPS


@pytest.mark.parametrize("iters", [1, 2, 3, 20])
def test_scaling_form_equals_reference(iters):
    x = _peaked(2, 3, 4, 4)
    want = sinkhorn_reference(x, iters, EPS)
    got = sinkhorn_scaling(x, iters, EPS)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    # and the iteration count matters at this tolerance (the check can fail)
    assert (sinkhorn_scaling(x, iters + 1, EPS) - want).abs().max() > 1e-4


def test_scaling_form_eps_and_dtype():
    """eps floors each sum exactly as in the reference (a large eps changes the result visibly), bf16 input is
    computed in fp32."""
    x = _peaked(5, 4, 4, seed=1)
    torch.testing.assert_close(sinkhorn_scaling(x, 20, 0.5), sinkhorn_reference(x, 20, 0.5), rtol=2e-6, atol=1e-7)
    xb = x.bfloat16()
    torch.testing.assert_close(sinkhorn_scaling(xb, 20, EPS), sinkhorn_reference(xb, 20, EPS), rtol=2e-6, atol=1e-7)


def test_scaling_form_gradient_equals_reference():
    x = _peaked(3, 4, 4, seed=2).double().requires_grad_()
    w = torch.randn(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (g_ref,) = torch.autograd.grad((sinkhorn_reference(x.float(), 20, EPS).double() * w).sum(), x)
    (g_got,) = torch.autograd.grad((sinkhorn_scaling(x.float(), 20, EPS).double() * w).sum(), x)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_host_form_equals_reference(iters):
    """The unrolled scalar form: every element of every row (each matrix is its own row loop) at fp32 rounding, a
    float32 tensor of the input's shape; one iteration more is visibly different."""
    x = _peaked(3, 4, 4, seed=4)
    want = sinkhorn_reference(x, iters, EPS)
    got = sinkhorn4_host(x, iters, EPS)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert (sinkhorn4_host(x, iters + 1, EPS) - want).abs().max() > 1e-4
    torch.testing.assert_close(sinkhorn4_host(x, iters, 0.5), sinkhorn_reference(x, iters, 0.5), rtol=2e-6, atol=1e-7)
    # not symmetric in rows and columns: the transposed input gives a different matrix (no index mix-up passes)
    assert (sinkhorn4_host(x.transpose(-1, -2).contiguous(), iters, EPS).transpose(-1, -2) - want).abs().max() > 1e-4
