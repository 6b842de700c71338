"""The causal depthwise conv (glm53/kernels/conv.py): the tap-loop reference, the grouped F.conv1d form and the
fast channels-last conv2d (forward and input gradient), forward and every gradient.

- fast vs the tap loop beside the bench shapes: sequences shorter than the kernel, width 2, fp64 (no oneDNN
  kernel: ATen's own depthwise conv), an initial state, an expanded (stride-0) output gradient.
- which form runs where: eagerly conv2d calls (the taps-as-rows op never runs); under torch.compile with the
  module's default shifted multiply-adds; a state in another dtype gives a final state in x's dtype; the packed
  custom ops' fake implementations give the real ops' dtypes for bf16 inputs.
- reference: tap loop vs grouped F.conv1d, state continuity, transformers' conv, bad shapes.
- packed documents (`cu_seqlens`): equal to each document alone.

Legend: B batch, T time, D channels (H*K), W kernel width.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import conv
from glm53.kernels.conv import causal_conv1d, causal_conv1d_reference
from tests.helpers.kernel_checks import (
    FP32_TOL,
    LAYOUTS,
    assert_all_close,
    cu_for,
    grads,
)

TOL = dict(rtol=1e-5, atol=1e-6)  # both compute in fp32 (also for fp64 inputs); the sums' order differs


def _run(fn, x, weight, state, expanded: bool):
    ins = [t.detach().clone().requires_grad_(True) for t in (x, weight) + (() if state is None else (state,))]
    y, final = fn(ins[0], ins[1], initial_state=ins[2] if state is not None else None, output_final_state=True)
    if expanded:
        loss = y.sum()  # upstream gradient is a stride-0 expand of a scalar
    else:
        loss = (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)).sum()
    return y.detach(), final.detach(), torch.autograd.grad(loss, ins)


@pytest.mark.parametrize("T", [1, 2, 3, 37])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_state", [False, True])
def test_fast_conv_equals_reference(T, W, dtype, with_state):
    gen = torch.Generator().manual_seed(T * 10 + W)
    B, D = 2, 6
    x = torch.randn(B, T, D, generator=gen, dtype=dtype)
    weight = torch.randn(D, W, generator=gen, dtype=dtype)
    state = torch.randn(B, D, W - 1, generator=gen, dtype=dtype) if with_state else None
    for expanded in (False, True):
        y_ref, s_ref, g_ref = _run(causal_conv1d_reference, x, weight, state, expanded)
        y, s, g = _run(causal_conv1d, x, weight, state, expanded)
        assert y.shape == (B, T, D)
        torch.testing.assert_close(y, y_ref.to(y.dtype), **TOL)
        torch.testing.assert_close(s, s_ref)
        for name, a, b in zip(("x", "weight", "state"), g, g_ref):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_fast_conv_empty_sequence():
    x, weight = torch.randn(2, 0, 5), torch.randn(5, 4)
    y, final = causal_conv1d(x, weight, output_final_state=True)
    assert y.shape == (2, 0, 5)
    torch.testing.assert_close(final, torch.zeros(2, 5, 3))


@pytest.mark.parametrize("shifted", [True, False], ids=["shifted", "conv2d"])
def test_compiled_conv_equals_reference_and_traces_shifted_multiply_adds(shifted, monkeypatch):
    """Under torch.compile the conv (and its input gradient) is W shifted multiply-adds, which inductor fuses, unless
    SHIFTED_WHEN_COMPILING is off; both traced forms equal the tap loop, forward and every gradient."""
    from glm53.kernels import conv

    monkeypatch.setattr(conv, "SHIFTED_WHEN_COMPILING", shifted)
    ops: list[str] = []

    def backend(gm, example_inputs):  # records the ATen ops of the forward and backward graphs (AOT autograd)
        def record(g, _):
            ops.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return g

        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    x, weight, state = torch.randn(2, 19, 6, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(2, 6, 3)
    compiled = torch.compile(causal_conv1d, backend=backend, fullgraph=True)
    y_ref, s_ref, g_ref = _run(causal_conv1d_reference, x, weight, state, False)
    y, s, g = _run(compiled, x, weight, state, False)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(s, s_ref)
    for name, a, b in zip(("x", "weight", "state"), g, g_ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"d{name}: {m}")
    convolutions = [op for op in ops if "convolution" in op]
    assert (not convolutions) if shifted else len(convolutions) == 2, ops  # forward and input gradient


def test_conv_taps_custom_op_fake_and_schema():
    """glm53::conv_taps_as_rows (the compiled shifted form's weight rows): opcheck runs it against its fake
    implementation, schema and dispatch; the rows are the taps, contiguous."""
    from glm53.kernels.conv import _taps_as_rows

    w = torch.randn(6, 4)
    torch.library.opcheck(_taps_as_rows, (w,), test_utils=("test_schema", "test_faketensor"))
    rows = _taps_as_rows(w)
    assert rows.is_contiguous()
    torch.testing.assert_close(rows, w.t(), rtol=0, atol=0)


# ---------------------------------------------------------------------------- which form runs where, dtypes, custom ops
B, T, D, W = 2, 9, 6, 4


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g), torch.randn(D, W, generator=g), torch.randn(B, D, W - 1, generator=g)


@pytest.mark.parametrize("long", [True, False], ids=["long", "short"])
def test_eager_runs_conv2d_forward_and_input_gradient_and_never_the_taps_op(monkeypatch, long):
    """Eager: conv2d for the forward and the input gradient of a sequence longer than SHIFTED_MAX_LENGTH; the windows'
    products and their sum (no conv2d) for a short one, as in a decode step; never the compiled form's taps op."""
    calls = {"conv2d": 0, "taps": 0}
    conv2d, taps = torch.nn.functional.conv2d, conv._taps_as_rows

    def counting_conv2d(*args, **kwargs):
        calls["conv2d"] += 1
        return conv2d(*args, **kwargs)

    def counting_taps(w):
        calls["taps"] += 1
        return taps(w)

    monkeypatch.setattr(torch.nn.functional, "conv2d", counting_conv2d)
    monkeypatch.setattr(conv, "_taps_as_rows", counting_taps)
    x, w, _ = inputs()
    x = (x.repeat(1, 3, 1) if long else x).requires_grad_()  # 27 or 9 steps, around SHIFTED_MAX_LENGTH
    if long:  # the forward's outputs (T) and the input gradient's (T + W - 1) past the limit, or both within it
        assert x.shape[1] > conv.SHIFTED_MAX_LENGTH
    else:
        assert x.shape[1] + W - 1 <= conv.SHIFTED_MAX_LENGTH
    y, _ = causal_conv1d(x, w)
    y.backward(torch.ones_like(y))
    assert calls == {"conv2d": 2 if long else 0, "taps": 0}
    want_y, _ = causal_conv1d_reference(x.detach(), w)
    torch.testing.assert_close(y.detach(), want_y, **TOL)


def test_compiled_default_traces_shifted_multiply_adds_through_the_taps_op():
    """The module default (no monkeypatch): no convolution in the forward or backward graph, the taps op in it."""
    assert conv.SHIFTED_WHEN_COMPILING
    ops: list[str] = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def record(g, _):
            ops.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g)

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    x, w, state = inputs(1)
    x.requires_grad_()
    y, _ = torch.compile(causal_conv1d, backend=backend, fullgraph=True)(x, w, initial_state=state)
    y.backward(torch.ones_like(y))
    assert not [op for op in ops if "convolution" in op] and "glm53.conv_taps_as_rows.default" in ops, ops
    ref, _ = causal_conv1d_reference(x.detach(), w, initial_state=state)
    torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-6)


def test_state_in_another_dtype_gives_a_final_state_in_x_dtype():
    x, w, state = inputs(2)
    for fn in (causal_conv1d_reference, causal_conv1d):
        y, final = fn(x, w, initial_state=state.double(), output_final_state=True)
        assert final.dtype == torch.float32 and y.dtype == torch.float32
        want_y, want_final = causal_conv1d_reference(x, w, initial_state=state, output_final_state=True)
        torch.testing.assert_close(final, want_final)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)


def test_packed_custom_ops_fake_dtypes_match_real_for_bf16_inputs():
    x, w, _ = inputs(3)
    flat = x.reshape(1, B * T, D).bfloat16()
    cu = torch.tensor([0, 4, 9, 18])
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(conv._packed_conv_op, (flat, w, cu), test_utils=utils)
    y = conv._packed_conv_op(flat, w, cu)
    assert y.dtype == torch.float32
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(conv._packed_conv_backward_op, (flat, w, cu, dy), test_utils=utils)
    dx, dw = conv._packed_conv_backward_op(flat, w, cu, dy)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32


def test_packed_documents_refuse_states():
    """Every packed document starts from an empty history: a state (in or out) with cu_seqlens raises."""
    x, w, state = inputs(5)
    cu = torch.tensor([0, 4, 9, 18])
    for fn in (causal_conv1d_reference, causal_conv1d):
        with pytest.raises(ValueError, match="initial_state / output_final_state are not supported with cu_seqlens"):
            fn(x, w, initial_state=state, cu_seqlens=cu)
        with pytest.raises(ValueError, match="not supported with cu_seqlens"):
            fn(x, w, output_final_state=True, cu_seqlens=cu)


# ------------------------------------------------------------ reference: tap loop vs grouped F.conv1d, state continuity
CONV_CASES = [(1, 1, 3, 4), (2, 9, 5, 4), (2, 20, 6, 3), (1, 7, 4, 2)]  # B, T, D, W


CONV_IDS = [f"B{b}-T{t}-D{d}-W{w}" for b, t, d, w in CONV_CASES]


def conv_by_hand(x, weight, state=None):
    """y[b, t, d] = sum_w weight[d, w] x[b, t - (W-1) + w, d], with x before 0 read from the state (or 0)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    history = torch.zeros(B, D, W - 1) if state is None else state
    full = torch.cat([history.transpose(1, 2), x], dim=1)  # [B, W-1+T, D]
    y = torch.zeros(B, T, D)
    for t in range(T):
        for w in range(W):
            y[:, t] += weight[:, w] * full[:, t + w]
    return y


@pytest.mark.parametrize("with_state", [False, True], ids=["nostate", "state"])
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_causal_conv1d_reference_vs_eager(case, with_state):
    B, T, D, W = case
    x, weight = torch.randn(B, T, D), torch.randn(D, W)
    state = torch.randn(B, D, W - 1) if with_state else None
    leaves = [t.clone().requires_grad_(True) for t in (x, weight) + ((state,) if with_state else ())]
    results = []
    for fn in (causal_conv1d_reference, causal_conv1d):
        ins = [t.detach().clone().requires_grad_(True) for t in leaves]
        y, final = fn(ins[0], ins[1], initial_state=ins[2] if with_state else None, output_final_state=True)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
        results.append((y.detach(), final.detach(), torch.autograd.grad((y * cot).sum(), ins)))
    (y_ref, s_ref, g_ref), (y, s, g) = results
    torch.testing.assert_close(y_ref, conv_by_hand(x, weight, state))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)
    full = torch.cat([torch.zeros(B, D, W - 1) if state is None else state, x.transpose(1, 2)], dim=-1)
    torch.testing.assert_close(s_ref, full[:, :, -(W - 1) :])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fn", [causal_conv1d_reference, causal_conv1d], ids=["reference", "fast"])
def test_causal_conv1d_state_continuity(fn):
    """conv over [a; b] == conv(a), then conv(b) from a's final state; also for a shorter than the kernel."""
    x, weight = torch.randn(2, 15, 5), torch.randn(5, 4)
    full, _ = fn(x, weight)
    for split in (1, 2, 9):
        ya, state = fn(x[:, :split], weight, output_final_state=True)
        yb, _ = fn(x[:, split:], weight, initial_state=state)
        torch.testing.assert_close(torch.cat([ya, yb], dim=1), full)


def test_causal_conv1d_matches_transformers():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    x, weight = torch.randn(2, 11, 6), torch.randn(6, 4)
    expected = hf.causal_conv1d_fn(x.transpose(1, 2), weight).transpose(1, 2)
    for fn in (causal_conv1d_reference, causal_conv1d):
        torch.testing.assert_close(fn(x, weight)[0], expected)


def test_causal_conv1d_rejects_bad_shapes():
    x = torch.randn(2, 5, 6)
    for fn in (causal_conv1d_reference, causal_conv1d):
        with pytest.raises(ValueError, match=r"conv weight has shape \(5, 4\), expected \(6, W\)"):
            fn(x, torch.randn(5, 4))
        with pytest.raises(ValueError, match=r"conv state has shape \(2, 6, 2\), expected \(2, 6, 3\)"):
            fn(x, torch.randn(6, 4), initial_state=torch.randn(2, 6, 2))


# ---------------------------------------------------------------------------------------- packed documents (cu_seqlens)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conv_packed_matches_per_document_reference(layout):
    B, T, lengths = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 12, generator=gen, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, requires_grad=True)
    cu = cu_for(lengths)
    ref, _ = causal_conv1d_reference(x, w, cu_seqlens=cu)
    got, _ = causal_conv1d(x, w, cu_seqlens=cu)
    assert_all_close((got,), (ref,), FP32_TOL, ["y"])
    assert_all_close(grads(got, [x, w]), grads(ref, [x, w]), FP32_TOL, ["dx", "dweight"])
    # each document alone, through the unpacked fast conv
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        b, s0 = divmod(s, T)
        alone, _ = causal_conv1d(x[b : b + 1, s0 : s0 + e - s], w)
        torch.testing.assert_close(got[b : b + 1, s0 : s0 + e - s], alone, rtol=1e-5, atol=1e-6)
