"""An upper bound on the ops one decode step dispatches (glm53/generation/decode.py) for the tiny config at batch 1.

Legend (glm53/model/__init__.py): B batch.
A decode step on the CPU costs per dispatched op as much as per weight byte, so an added op per layer is a
regression even when the numbers stay right: this counts every aten call of one step (a TorchDispatchMode) and
fails above the pinned bound (the count when it was pinned plus a small margin; lower it when a change cuts ops).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.generation import GenerationCache
from glm53.generation.decode import decode_step
from tests.helpers.generation import tiny_model

MAX_OPS = 500  # 488 when pinned (4 layers, N = 4, one MoE token path)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _step_ops(model) -> int:
    ids = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = GenerationCache(model)
        model.model(ids, cache=cache)
        decode_step(model, cache, ids[:, -1])  # the first step builds the plan
        counter = _Count()
        with counter:
            decode_step(model, cache, ids[:, -1])
    return counter.calls


def test_decode_step_op_count_is_bounded():
    model = tiny_model()
    layers = model.config.num_hidden_layers
    ops = _step_ops(model)
    assert ops <= MAX_OPS, f"a decode step dispatched {ops} ops ({ops / layers:.0f} per layer), bound {MAX_OPS}"
