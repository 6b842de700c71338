"""The grouped expert matmul (kernels/moe.py) on cases the parity grid of test_kernels_fast.py leaves out: frozen
inputs (only the expert weights need a gradient, and the other way round), a loss whose gradient is expanded
(stride 0, from .sum()), and idle experts at both ends of the expert axis. Each against the per-expert loop.

Legend: M tokens, D model width, I expert width, E experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.moe import _grouped_mm_usable, moe_experts_grouped, moe_experts_padded, moe_experts_reference

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
