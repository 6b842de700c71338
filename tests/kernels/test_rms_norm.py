"""The RMS norms (glm53/kernels/rms_norm.py): the fast rms_norm and gated_rms_norm equal their references, forward
and every gradient, fp32 and bf16 (a tiny-RMS row where the eps matters); both backends against the formulas
written out in fp64 (FORMULA_FWD_TOL / FORMULA_BWD_TOL, tests/helpers/kernel_checks.py), with frozen inputs too.

Legend: B batch, T time, H heads, D width.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference
from tests.helpers.kernel_checks import (
    BF16_TOL,
    FORMULA_BWD_TOL,
    FP32_TOL,
    assert_all_close,
    check_against_formula,
    fp64_inputs,
    grads,
)

NORM_SHAPES = [(2, 7, 16), (1, 1, 5), (3, 4, 2, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=["B2-T7-D16", "B1-T1-D5", "B3-T4-H2-D8"])
def test_rms_norm_equals_reference(shape, dtype):
    from glm53.kernels.rms_norm import rms_norm, rms_norm_reference

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    x.data[0, 0].mul_(1e-3)  # a tiny-RMS row: the eps inside the rsqrt matters there
    w = (1 + torch.randn(shape[-1], generator=gen)).requires_grad_()  # the weight stays fp32
    ref, got = rms_norm_reference(x, w, 1e-5), rms_norm(x, w, 1e-5)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # same forward arithmetic
    g_got, g_ref = grads(got, [x, w]), grads(ref, [x, w])
    assert [g.dtype for g in g_got] == [g.dtype for g in g_ref]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL  # both compute in fp32; bf16 rounds the outputs
    assert_all_close(g_got, g_ref, tol, ["dx", "dweight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=["B2-T7-D16", "B1-T1-D5", "B3-T4-H2-D8"])
def test_gated_rms_norm_equals_reference(shape, dtype):
    from glm53.kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    gate = (2 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    w = (1 + torch.randn(shape[-1], generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    ref, got = gated_rms_norm_reference(x, gate, w, 1e-5), gated_rms_norm(x, gate, w, 1e-5)
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    g_got, g_ref = grads(got, [x, gate, w]), grads(ref, [x, gate, w])
    assert [g.dtype for g in g_got] == [dtype] * 3
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL  # both compute in fp32; bf16 rounds the outputs
    assert_all_close(g_got, g_ref, tol, ["dx", "dgate", "dweight"])


# --------------------------------------------------------------------------------------------- against the fp64 formula
EPS = 1e-5


def rms_formula(x, w):
    return w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + EPS)


def gated_formula(x, gate, w):
    return rms_formula(x, w) / (1 + torch.exp(-gate))


@pytest.mark.parametrize("kernel", [rms_norm, rms_norm_reference], ids=["fast", "reference"])
def test_rms_norm_is_the_formula(kernel):
    x, w = fp64_inputs((3, 7, 16), (16,))
    x = 3 * x
    x[0, 0] *= 1e-3  # a tiny-RMS row: the eps matters there
    check_against_formula(lambda x, w: kernel(x, w, EPS), rms_formula, [x, 1 + w])


@pytest.mark.parametrize("kernel", [gated_rms_norm, gated_rms_norm_reference], ids=["fast", "reference"])
def test_gated_rms_norm_is_the_formula(kernel):
    x, gate, w = fp64_inputs((3, 5, 2, 8), (3, 5, 2, 8), (8,))
    check_against_formula(lambda x, g, w: kernel(x, g, w, EPS), gated_formula, [3 * x, 2 * gate, 1 + w])


@pytest.mark.parametrize("frozen", [0, 1, 2], ids=["x-frozen", "second-frozen", "weight-frozen"])
@pytest.mark.parametrize("op", ["rms_norm", "gated_rms_norm"])
def test_norm_gradients_with_frozen_inputs(op, frozen):
    """A frozen input (a norm weight not trained, a gate from a frozen branch) gets no gradient, the others
    still get the formula's: the hand-written backwards skip exactly the gradients nobody asked for."""
    x, gate, w = fp64_inputs((3, 5, 8), (3, 5, 8), (8,))
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
            torch.testing.assert_close(a.grad.double(), b.grad, **FORMULA_BWD_TOL)
