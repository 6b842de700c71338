"""Per-device kernel backends (kernels/dispatch.py): a CUDA-only backend (fla's chunk_kda for "kda") is chosen
explicitly per (op, device type), resolved on each call from the inputs' device, and logged; a process-wide
use_backend still wins. No GPU here: the meta device stands in for cuda and a recording stand-in for the Triton
kernel. The fla backend's parity with the reference runs only where a GPU and flash-linear-attention exist.

Legend: B batch, T time, H heads, K/V widths.
"""

from __future__ import annotations

import logging

import pytest
import torch

from glm53.kernels import dispatch, kernel, use_backend
from glm53.kernels.kda import fla_backend, kda_chunk, kda_recurrent_reference
from tests.helpers.kernel_checks import assert_all_close, kda_inputs


@pytest.fixture
def standin():
    calls = []

    def fake_triton(q, k, v, g, beta, **kwargs):
        calls.append(q.device.type)
        return torch.zeros_like(v), None

    dispatch.register("kda", "standin", fake_triton)
    yield calls
    del dispatch._REGISTRY["kda"]["standin"]
    dispatch._DEVICE_KERNELS.pop(("kda", None), None)


def test_device_backend_runs_only_on_its_device(standin, caplog):
    xs = [x.detach().float() for x in kda_inputs(1, 40, 2, 8, 8, "bounded")[:5]]
    assert kernel("kda") is kda_chunk  # nothing chosen: the fast kernel itself
    with caplog.at_level(logging.INFO, logger="glm53.kernels"), dispatch.use_device_backend("kda", "meta", "standin"):
        fn = kernel("kda")  # resolved once (as a module does), follows each call's device
        assert dispatch.resolve("kda", "meta") == "standin" and dispatch.resolve("kda", "cpu") == "fast"
        fn(*(x.to("meta") for x in xs))
        fn(*(x.to("meta") for x in xs))
        cpu_out = fn(*xs)[0]
        with use_backend("reference", ["kda"]):  # a process-wide choice wins over the per-device one
            assert dispatch.resolve("kda", "meta") == "reference"
            assert kernel("kda") is kda_recurrent_reference
    assert standin == ["meta", "meta"]
    assert torch.equal(cpu_out, kda_chunk(*xs)[0])
    assert kernel("kda") is kda_chunk and dispatch.resolve("kda", "meta") == "fast"  # restored on exit
    logged = [r.getMessage() for r in caplog.records if "on meta" in r.getMessage()]
    assert logged == ["glm53 kernel kda on meta: using the standin implementation"]


def test_unknown_device_backend_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'fla2' for kernel op 'kda'; registered: \["):
        dispatch.set_device_backend("kda", "cuda", "fla2")
    with pytest.raises(RuntimeError):
        dispatch.set_device_backend("kda", "cudda", "fast")


def test_fla_backend_registered_exactly_when_installed():
    assert ("fla" in dispatch.backends("kda")) == fla_backend.AVAILABLE


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_backend.AVAILABLE), reason="needs a GPU and flash-linear-attention"
)
@pytest.mark.parametrize("packed", [False, True])
def test_fla_backend_matches_recurrent_reference_on_gpu(packed):
    # fla's Triton dots may run in TF32 (2^-11 relative per product) over K = 64 and C = 64 accumulations:
    # about 2^-11 * sqrt(64 * 64) ~ 3e-2 worst-case relative; 1e-2 of the output scale is the bound used
    tol = dict(rtol=1e-2, atol=1e-2)
    xs = [x.detach().float().cuda().requires_grad_() for x in kda_inputs(2, 200, 4, 64, 64, "bounded")[:5]]
    cu = torch.tensor([0, 70, 200, 330, 400], device="cuda") if packed else None
    ref, _ = kda_recurrent_reference(*xs, cu_seqlens=cu)
    with dispatch.use_device_backend("kda", "cuda", "fla"):
        got, _ = kernel("kda")(*xs, cu_seqlens=cu)
    assert_all_close((got,), (ref,), tol, ["o"])
    cot = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, xs, cot)
    g_got = torch.autograd.grad(got, xs, cot)
    assert_all_close(g_got, g_ref, tol, ["dq", "dk", "dv", "dg", "dbeta"])
