"""kernels/function.py: `apply` runs a Function's forward without autograd's node exactly when no gradient can be
asked for, and gives the same values either way."""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.function import apply
from glm53.kernels.rms_norm import _RmsNorm
from glm53.kernels.sinkhorn import _Sinkhorn


class _Scale(torch.autograd.Function):
    """y = 3 x, saving x and a non-tensor attribute as a kernel's forward does."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(x)
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def test_a_gradient_goes_through_the_function_node():
    x = torch.randn(5, requires_grad=True)
    y = apply(_Scale, x, 3.0)
    assert type(y.grad_fn).__name__ == "_ScaleBackward"
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["inference", "no_grad", "no_input_requires_grad"])
def test_without_a_gradient_the_forward_runs_alone(monkeypatch, mode):
    x = torch.randn(5, requires_grad=mode != "no_input_requires_grad")

    def refuse(*args):
        raise AssertionError("Function.apply ran although no gradient can be asked for")

    monkeypatch.setattr(_Scale, "apply", refuse)
    context = {"inference": torch.inference_mode(), "no_grad": torch.no_grad()}.get(mode, torch.enable_grad())
    with context:
        y = apply(_Scale, x, 3.0)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, x.detach() * 3.0, rtol=0, atol=0)


@pytest.mark.parametrize(
    "function, args",
    [
        (_Sinkhorn, lambda g: (torch.rand(2, 3, 4, 4, generator=g) + 0.1, 20, 1e-6)),
        (_RmsNorm, lambda g: (torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g), 1e-6)),
    ],
    ids=["sinkhorn", "rms_norm"],
)
def test_kernel_values_are_the_same_with_and_without_the_node(function, args):
    inputs = args(torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = apply(function, *inputs)
    tracked = apply(function, *(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs))
    assert tracked.grad_fn is not None
    torch.testing.assert_close(alone, tracked.detach(), rtol=0, atol=0)  # the same forward code: bit-identical
