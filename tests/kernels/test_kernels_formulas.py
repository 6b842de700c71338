"""RMS norms and the mHC collapse against formulas written out here in fp64, forward and every gradient, for both
backends. (test_kernels_fast.py checks fast == reference exactly; both share helpers, so a slip in a shared helper
would pass there and fails here.)

Legend: B batch, T time, N streams, D width.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.hc_collapse import hc_collapse, hc_collapse_reference
from glm53.kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference

EPS = 1e-5
FWD = dict(rtol=2e-6, atol=2e-6)  # fp32 kernels vs the fp64 formula
BWD = dict(rtol=2e-5, atol=2e-6)


def inputs(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


def check(kernel, formula, xs):
    """kernel on fp32 leaves vs formula on fp64 leaves holding the same values: output and all gradients."""
    low = [x.float().requires_grad_() for x in xs]
    high = [x.float().double().requires_grad_() for x in xs]
    got, want = kernel(*low), formula(*high)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **FWD)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    g_got = torch.autograd.grad(got, low, cot.float())
    g_want = torch.autograd.grad(want, high, cot)
    for i, (a, b) in enumerate(zip(g_got, g_want)):
        torch.testing.assert_close(a.double(), b, **BWD, msg=lambda m, i=i: f"gradient of input {i}: {m}")


def rms_formula(x, w):
    return w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + EPS)


def gated_formula(x, gate, w):
    return rms_formula(x, w) / (1 + torch.exp(-gate))


@pytest.mark.parametrize("kernel", [rms_norm, rms_norm_reference], ids=["fast", "reference"])
def test_rms_norm_is_the_formula(kernel):
    x, w = inputs((3, 7, 16), (16,))
    x = 3 * x
    x[0, 0] *= 1e-3  # a tiny-RMS row: the eps matters there
    check(lambda x, w: kernel(x, w, EPS), rms_formula, [x, 1 + w])


@pytest.mark.parametrize("kernel", [gated_rms_norm, gated_rms_norm_reference], ids=["fast", "reference"])
def test_gated_rms_norm_is_the_formula(kernel):
    x, gate, w = inputs((3, 5, 2, 8), (3, 5, 2, 8), (8,))
    check(lambda x, g, w: kernel(x, g, w, EPS), gated_formula, [3 * x, 2 * gate, 1 + w])


@pytest.mark.parametrize("kernel", [hc_collapse, hc_collapse_reference], ids=["fast", "reference"])
def test_hc_collapse_is_the_weighted_stream_sum(kernel):
    pre, streams = inputs((2, 6, 4), (2, 6, 4, 16))

    def formula(pre, streams):
        return sum(pre[:, :, n, None] * streams[:, :, n] for n in range(streams.shape[2]))

    check(kernel, formula, [pre.abs(), streams])


@pytest.mark.parametrize("frozen", [0, 1, 2], ids=["x-frozen", "second-frozen", "weight-frozen"])
@pytest.mark.parametrize("op", ["rms_norm", "gated_rms_norm"])
def test_norm_gradients_with_frozen_inputs(op, frozen):
    """A frozen input (a norm weight not trained, a gate from a frozen branch) gets no gradient, the others
    still get the formula's: the hand-written backwards skip exactly the gradients nobody asked for."""
    x, gate, w = inputs((3, 5, 8), (3, 5, 8), (8,))
    if op == "rms_norm":
        kernel, formula, xs = (lambda x, w: rms_norm(x, w, EPS)), rms_formula, [3 * x, 1 + w]
        frozen = min(frozen, 1)
    else:
        kernel, formula, xs = (lambda x, g, w: gated_rms_norm(x, g, w, EPS)), gated_formula, [3 * x, 2 * gate, 1 + w]
    low = [t.float().requires_grad_(i != frozen) for i, t in enumerate(xs)]
    high = [t.float().double().requires_grad_(i != frozen) for i, t in enumerate(xs)]
    got, want = kernel(*low), formula(*high)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (got * cot.float()).sum().backward()
    (want * cot).sum().backward()
    for i, (a, b) in enumerate(zip(low, high)):
        if i == frozen:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad.double(), b.grad, **BWD)
