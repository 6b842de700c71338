"""Sinkhorn normalisation of the mHC residual mix (glm53/kernels/sinkhorn.py): the reference converges to a doubly
stochastic matrix and matches transformers' inline loop; the fast kernel's hand-written backward equals autograd
through the iterations (1, 2 and 20).

Legend: N streams (the matrix is N x N).
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53.kernels.sinkhorn import sinkhorn_reference
from tests.helpers.kernel_checks import grads


@pytest.mark.parametrize("n", [1, 2, 4, 6], ids=lambda n: f"N{n}")
def test_sinkhorn_converges_to_doubly_stochastic(n):
    x = torch.softmax(torch.randn(3, 5, n, n) * 3, dim=-1) + 1e-6
    out = sinkhorn_reference(x, 200, 1e-6)
    torch.testing.assert_close(out.sum(-1), torch.ones(3, 5, n), rtol=0, atol=1e-4)
    torch.testing.assert_close(out.sum(-2), torch.ones(3, 5, n), rtol=0, atol=1e-4)
    # a doubly stochastic scaling of x: out = diag(r) x diag(c), so out / x has rank one
    ratio = out / x
    torch.testing.assert_close(ratio * ratio[..., :1, :1], ratio[..., :, :1] * ratio[..., :1, :], rtol=1e-4, atol=0)


@pytest.mark.parametrize("iters", [1, 2, 20], ids=lambda i: f"iters{i}")
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"N{n}")
def test_sinkhorn_matches_transformers(n, iters):
    """With fn = 0 the comb logits are the base, so transformers' module returns sinkhorn(softmax(base) + eps)."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next import modeling_glm5_next as hf

    hc = hf.Glm5NextTextHyperConnection(Glm5NextTextConfig(hidden_size=8, hc_mult=n, hc_sinkhorn_iters=iters))
    logits = torch.randn(n, n) * 2
    with torch.no_grad():
        hc.fn.zero_()
        hc.scale.fill_(1.0)
        hc.base.copy_(torch.cat([torch.zeros(2 * n), logits.flatten()]))
        _, comb, _ = hc(torch.randn(1, 1, n, 8))
    ours = sinkhorn_reference(torch.softmax(logits, -1) + hc.hc_eps, iters, hc.hc_eps)
    torch.testing.assert_close(ours, comb[0, 0], rtol=1e-6, atol=1e-7)
    if iters == 1:
        # one iteration is a single column normalisation: columns sum to 1, rows in general do not
        torch.testing.assert_close(ours.sum(-2), torch.ones(n), rtol=0, atol=1e-5)
        assert not torch.allclose(ours.sum(-1), torch.ones(n), atol=1e-3)
    assert math.isclose(float(ours.sum()), n, rel_tol=1e-4)


# --------------------------------------------------------------------- fast backward vs autograd through the iterations
@pytest.mark.parametrize("eps", [1e-6, 0.1], ids=["eps1e-6", "eps0.1"])  # 0.1: an eps in the wrong place shows
@pytest.mark.parametrize("iters", [1, 2, 20], ids=["iters1", "iters2", "iters20"])
def test_sinkhorn_backward_equals_autograd(iters, eps):
    from glm53.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    N = 4
    gen = torch.Generator().manual_seed(0)
    x = (torch.softmax(torch.randn(3, 5, N, N, generator=gen, dtype=torch.float64), -1) + eps).requires_grad_()
    ref, got = sinkhorn_reference(x, iters, eps), sinkhorn(x, iters, eps)
    # fp32 inside both; the fast kernel sums N + 1 terms (eps among them) in one reduction, in its own order: each of
    # the 2 * iters - 1 normalisations may round its sum by up to N ulps and its quotient by one
    rtol = (2 * iters - 1) * (N + 1) * 2.0**-24
    torch.testing.assert_close(got, ref, rtol=rtol, atol=0)
    torch.testing.assert_close(grads(got, [x])[0], grads(ref, [x])[0], rtol=1e-5, atol=1e-6)
