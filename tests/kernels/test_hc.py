"""Manifold-constrained hyper-connections' kernels (glm53/kernels/hc_collapse.py, hc_mix.py, hc_project.py): fast
vs reference, forward and every gradient, fp32 and bf16; the collapse against its formula in fp64 (a slip in a
helper both backends share passes the fast == reference test and fails this one); the fast collapse bit-equal to
the reference in bf16; the final stream collapse is transformers' unweighted mean; HyperConnection.init_weights is
transformers' initialisation. Sinkhorn has its own file (test_sinkhorn.py).

Legend: B batch, T time, N streams, D model width.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53.config import Glm53Config
from glm53.kernels.hc_collapse import hc_collapse, hc_collapse_reference
from glm53.model.hyper_connection import HyperConnection, collapse_streams, expand_streams
from tests.helpers.kernel_checks import (
    BF16_TOL,
    FP32_TOL,
    assert_all_close,
    check_against_formula,
    fp64_inputs,
    grads,
)


def test_hc_collapse_bf16_is_bit_equal_to_reference():
    torch.manual_seed(0)
    pre = torch.rand(2, 5, 4, requires_grad=True)  # [B, T, N] fp32
    streams = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16, requires_grad=True)  # [B, T, N, D]
    grad = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    outs = []
    for fn in (hc_collapse_reference, hc_collapse):
        out = fn(pre, streams)
        outs.append((out, *torch.autograd.grad(out, (pre, streams), grad)))
    for ref, got in zip(*outs):
        assert ref.dtype == got.dtype
        assert torch.equal(ref, got)


def test_stream_collapse_is_transformers_mean():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)  # [B, T, D]
    streams = expand_streams(x, 4) + torch.randn(2, 3, 4, 8)  # [B, T, N, D]
    head = hf.Glm5NextTextHyperHead()
    assert torch.equal(collapse_streams(streams), head(streams))
    assert torch.allclose(collapse_streams(expand_streams(x, 4)), x)


def test_init_weights_is_transformers_init():
    config = Glm53Config.tiny(hc_mult=4)
    hc = HyperConnection(config)
    torch.manual_seed(0)
    hc.init_weights()
    assert torch.equal(hc.scale, torch.ones(3)) and torch.equal(hc.base, torch.zeros(hc.base.shape))
    assert abs(hc.fn.std().item() - 0.02) < 0.002 and abs(hc.fn.mean().item()) < 0.002


# ----------------------------------------------------------------------------- fast vs reference, forward and gradients
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hc_collapse_equals_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    pre = torch.rand(2, 7, 4, generator=gen).requires_grad_()
    streams = torch.randn(2, 7, 4, 16, generator=gen).to(dtype).requires_grad_()
    ref = hc_collapse_reference(pre, streams)
    got = hc_collapse(pre, streams)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert_all_close(
        grads(got, [pre, streams]),
        grads(ref, [pre, streams]),
        FP32_TOL if dtype == torch.float32 else BF16_TOL,
        ["dpre", "dstreams"],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(2, 7, 4, 16), (1, 1, 3, 5), (3, 5, 1, 8)], ids=["B2-T7-N4-D16", "B1-T1-N3-D5", "B3-T5-N1-D8"]
)
def test_hc_mix_equals_reference(shape, dtype):
    from glm53.kernels.hc_mix import hc_mix, hc_mix_reference

    B, T, N, D = shape
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(B, T, N, D, generator=gen).to(dtype).requires_grad_()
    comb = torch.rand(B, T, N, N, generator=gen).requires_grad_()  # fp32 coefficients, as the module passes them
    post = (2 * torch.rand(B, T, N, generator=gen)).requires_grad_()
    out = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    inputs = [streams, comb, post, out]
    ref, got = hc_mix_reference(*inputs), hc_mix(*inputs)
    assert got.dtype == ref.dtype == dtype and got.shape == (B, T, N, D)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_all_close((got,), (ref,), tol, ["new"])
    g_got, g_ref = grads(got, inputs), grads(ref, inputs)
    assert [g.dtype for g in g_got] == [g.dtype for g in g_ref] == [dtype, torch.float32, torch.float32, dtype]
    assert_all_close(g_got, g_ref, tol, ["dstreams", "dcomb", "dpost", "dout"])


@pytest.mark.parametrize("shape", [(2, 7, 64), (1, 1, 12), (3, 40)], ids=["B2-T7-K64", "B1-T1-K12", "M3-K40"])
def test_hc_project_equals_reference(shape):
    from glm53.kernels.hc_project import hc_project, hc_project_reference

    gen = torch.Generator().manual_seed(0)
    flat = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()
    flat.data[0].mul_(1e-4)  # a token with a tiny RMS: the eps inside the rsqrt matters there
    fn = (0.1 * torch.randn(10, shape[-1], generator=gen, dtype=torch.float64)).requires_grad_()
    ref, got = hc_project_reference(flat, fn, 1e-5), hc_project(flat, fn, 1e-5)
    assert got.shape == (*shape[:-1], 10)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads(got, [flat, fn]), grads(ref, [flat, fn]), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------- against the fp64 formula
@pytest.mark.parametrize("kernel", [hc_collapse, hc_collapse_reference], ids=["fast", "reference"])
def test_hc_collapse_is_the_weighted_stream_sum(kernel):
    pre, streams = fp64_inputs((2, 6, 4), (2, 6, 4, 16))

    def formula(pre, streams):
        return sum(pre[:, :, n, None] * streams[:, :, n] for n in range(streams.shape[2]))

    check_against_formula(kernel, formula, [pre.abs(), streams])
