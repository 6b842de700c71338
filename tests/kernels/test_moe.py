"""The routed experts' kernels (glm53/kernels/moe.py): grouped, padded and few-token forms against the per-expert
loop (the reference), forward and every gradient, fp32 and fp64, bf16 against fp32; the clamped SwiGLU's backward
(plain and packed) against autograd. Beyond the parity grid: frozen inputs (only the expert weights need a gradient,
and the other way round), a loss whose gradient is expanded (stride 0, from .sum()), idle experts at both ends.

Legend: M (N) tokens, D (H) model width, I expert width, E experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.moe import (
    _grouped_mm_usable,
    moe_experts_few_token,
    moe_experts_grouped,
    moe_experts_padded,
    moe_experts_reference,
)
from tests.helpers.kernel_checks import BF16_TOL, assert_all_close, grads

M, D, I, E, K = 9, 16, 8, 6, 2  # 16 * 4 and 8 * 4 bytes: torch._grouped_mm's alignment holds in fp32
FAST = {"grouped": moe_experts_grouped, "padded": moe_experts_padded}


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=gen)
    gate_up = torch.randn(E, 2 * I, D, generator=gen) / D**0.5
    down = torch.randn(E, D, I, generator=gen) / I**0.5
    # experts 0 and E - 1 get no token; expert 1 gets one; the rest share the others
    idx = torch.stack([torch.tensor([1, 2]) if m == 0 else torch.randperm(3, generator=gen)[:K] + 2 for m in range(M)])
    w = torch.rand(M, K, generator=gen)
    return x, idx, w, gate_up, down


def test_the_grouped_path_is_the_one_tested():
    x, _, _, gate_up, down = _inputs()
    assert _grouped_mm_usable(x, gate_up, down) == hasattr(torch, "_grouped_mm")


@pytest.mark.parametrize("frozen", ["x", "weights"])
@pytest.mark.parametrize("fast", list(FAST))
def test_gradients_when_one_side_is_frozen(fast, frozen):
    x, idx, w, gate_up, down = _inputs()
    trained = [gate_up, down] if frozen == "x" else [x, w]
    cot = torch.randn(M, D, generator=torch.Generator().manual_seed(1))
    got_ref = []
    for fn in (FAST[fast], moe_experts_reference):
        leaves = [t.detach().clone().requires_grad_() for t in trained]
        args = dict(zip(["gate_up", "down"] if frozen == "x" else ["x", "topk_weight"], leaves))
        args = {**dict(x=x, topk_weight=w, gate_up=gate_up, down=down), **args}
        out = fn(args["x"], idx, args["topk_weight"], args["gate_up"], args["down"], 1.0)
        got_ref.append((out, *torch.autograd.grad(out, leaves, cot)))
    for name, a, b in zip(["out", "d0", "d1"], *got_ref):
        assert a is not None and a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fast", list(FAST))
def test_sum_loss_expanded_gradient_and_idle_edge_experts(fast):
    """out.sum() hands backward a stride-0 gradient; experts 0 and E - 1 receive no token (zero gradient)."""
    leaves = [t.requires_grad_() for t in _inputs()[:1] + _inputs()[2:]]
    x, w, gate_up, down = leaves
    idx = _inputs()[1]
    got = torch.autograd.grad(FAST[fast](x, idx, w, gate_up, down, 1.0).sum(), leaves)
    ref = torch.autograd.grad(moe_experts_reference(x, idx, w, gate_up, down, 1.0).sum(), leaves)
    for name, a, b in zip(["dx", "dweight", "dgate_up", "ddown"], got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    for d in got[2:]:
        assert d[0].abs().max() == 0 and d[-1].abs().max() == 0 and d[1].abs().max() > 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch build has no torch._grouped_mm")
def test_grouped_mm_op_with_an_expanded_gradient_and_empty_groups():
    """The op alone: rows of groups [3, 0, 5, 0] (empty first-but-one and last groups), a .sum() loss (stride-0
    gradient, which the eager op rejects unless backward makes it contiguous); against per-group matmuls."""
    from glm53.kernels.moe import grouped_mm

    gen = torch.Generator().manual_seed(2)
    sizes = [3, 0, 5, 0]
    a = torch.randn(sum(sizes), 8, generator=gen, requires_grad=True)
    b = torch.randn(len(sizes), 8, 4, generator=gen, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    da, db = torch.autograd.grad(grouped_mm(a, b, offs).sum(), [a, b])
    expert = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ref_out = torch.einsum("mi,mio->mo", a, b[expert])
    ref_da, ref_db = torch.autograd.grad(ref_out.sum(), [a, b])
    torch.testing.assert_close(grouped_mm(a, b, offs), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(da, ref_da, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, ref_db, rtol=1e-5, atol=1e-5)
    assert db[1].abs().max() == 0 and db[3].abs().max() == 0


@pytest.mark.parametrize("fast", list(FAST))
def test_busiest_expert_last_and_first_idle(fast):
    """The padded form's capacity is the busiest expert's load: here the last expert's (every token), with
    expert 0 idle, so a capacity or offset that skips either end of the expert axis shows."""
    x, _, w, gate_up, down = _inputs(3)
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    idx = torch.stack([torch.tensor([E - 1, 1 + m % (E - 2)]) for m in range(M)])  # [M, k]
    got = FAST[fast](x, idx, w, gate_up, down, 1.0)
    ref = moe_experts_reference(x, idx, w, gate_up, down, 1.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    cot = torch.randn(M, D, generator=torch.Generator().manual_seed(4))
    for name, a, b in zip(
        ["dx", "dweight", "dgate_up", "ddown"],
        torch.autograd.grad(got, leaves, cot),
        torch.autograd.grad(ref, leaves, cot),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------- fast forms vs the expert loop, forward and gradients
MOE_CASES = {
    "N50-E6-k3-one-idle-expert": (50, 64, 32, 6, 3),
    "N1-E4-k2": (1, 16, 8, 4, 2),
    "N33-E8-k2-unaligned": (33, 12, 6, 8, 2),
}


@pytest.mark.parametrize(
    "fast", [moe_experts_grouped, moe_experts_padded, moe_experts_few_token], ids=["grouped", "padded", "few-token"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_grouped_equals_expert_loop(case, dtype, fast):
    N, H, I, E, k = MOE_CASES[case]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype).requires_grad_()
    idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(N)])  # expert E-1 gets no token
    w = torch.rand(N, k, generator=gen).requires_grad_()
    ref = moe_experts_reference(x, idx, w, gate_up, down, 1.0)
    got = fast(x, idx, w, gate_up, down, 1.0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert_all_close((got,), (ref,), tol, ["out"])
    inputs = [x, w, gate_up, down]
    assert_all_close(grads(got, inputs), grads(ref, inputs), tol, ["dx", "dweight", "dgate_up", "ddown"])


def test_clamped_swiglu_backward_equals_autograd():
    from glm53.kernels.moe import _clamped_swiglu_forward, clamped_swiglu

    gen = torch.Generator().manual_seed(0)
    gate, up = (3 * torch.randn(2, 40, 16, generator=gen, dtype=torch.float64)).requires_grad_().unbind(0)
    got, ref = clamped_swiglu(gate, up, 1.5), _clamped_swiglu_forward(gate, up, 1.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(grads(got, [gate, up]), grads(ref, [gate, up]), rtol=1e-12, atol=1e-12)
    assert (gate > 1.5).any() and (up.abs() > 1.5).any(), "both clamps must be exercised"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_packed_clamped_swiglu_equals_autograd(dtype):
    from glm53.kernels.moe import _clamped_swiglu_forward, clamped_swiglu_packed

    gen = torch.Generator().manual_seed(0)
    gate_up = (3 * torch.randn(40, 32, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    got, ref = clamped_swiglu_packed(gate_up, 1.5), _clamped_swiglu_forward(*gate_up.chunk(2, dim=-1), 1.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    (d_got,), (d_ref,) = grads(got, [gate_up]), grads(ref, [gate_up])
    assert d_got.shape == gate_up.shape and d_got.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(d_got, d_ref, **tol)


def test_moe_grouped_bf16_close_to_fp32_loop():
    gen = torch.Generator().manual_seed(0)
    N, H, I, E, k = 40, 64, 32, 6, 2
    x = torch.randn(N, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=gen)
    low = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    ref = moe_experts_reference(low[0].float(), idx, w, low[1].float(), low[2].float(), 1.0)
    got = moe_experts_grouped(low[0], idx, w, low[1], low[2], 1.0)
    assert got.dtype == torch.bfloat16
    assert_all_close((got,), (ref,), BF16_TOL, ["out"])
