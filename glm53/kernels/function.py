"""Calling the kernels' autograd Functions: `apply(Function, *args)`.

`Function.apply` costs about 3.5 us a call before the forward runs (the autograd node, the unpacking of its
inputs), more than the ops it wraps cost at a decode step (16 Sinkhorns, 27 norms, 16 mixes per token on a few
numbers each). While no gradient can be asked for (grad mode off, as in `torch.inference_mode`, or no input that
requires one) `apply` runs the Function's own forward with a stand-in context, dropped when it returns: the same
code, so the same values, without the node.
"""

from __future__ import annotations

import torch


class StandInContext:
    """An autograd context for a Function's forward (and backward) called directly: what forward saves or sets stays
    on it. `apply` drops it as soon as the forward returns; a custom op that runs a Function's forward and backward
    inside itself (kernels/conv.py, the packed conv's backward op) keeps it between the two."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def apply(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)`, or `function.forward` alone when no argument can receive a gradient."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(StandInContext(), *args)
