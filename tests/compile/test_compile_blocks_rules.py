"""`compile_blocks` (glm53/model/compile.py) on a stand-in model: its defaults and the GRAPH_BREAKING rule (a module
of its own: its autouse fixture resets dynamo around each test).

Legend: B batch, T time, D width.
A model with `model.layers` and `mtp.layers`, whose blocks are a Linear (one of them with a graph break): the
default is fullgraph (a break raises), fullgraph=False compiles through it, a GRAPH_BREAKING block stays eager
under fullgraph only, and the default static shapes compile one graph per sequence length.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from glm53.model import compile as compile_mod
from glm53.model.compile import compile_blocks, model_blocks

D = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


class BreakingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        torch._dynamo.graph_break()
        return y.relu()


def stand_in(*blocks: nn.Module, mtp: tuple[nn.Module, ...] = ()) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(blocks)
    model.mtp = nn.Module()
    model.mtp.layers = nn.ModuleList(mtp)
    return model


def is_compiled(block: nn.Module) -> bool:
    return hasattr(block.forward, "_torchdynamo_orig_callable")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_default_is_fullgraph_a_graph_break_raises():
    model = compile_blocks(stand_in(Block(), BreakingBlock()), backend="eager")
    x = torch.randn(2, 4, D)
    model.model.layers[0](x)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        model.model.layers[1](x)


def test_fullgraph_false_compiles_through_a_break_and_matches_eager():
    eager = stand_in(Block(), BreakingBlock(), mtp=(Block(),))
    x = torch.randn(2, 4, D)
    want = [b(x) for b in model_blocks(eager)]
    model = compile_blocks(eager, backend="eager", fullgraph=False)
    assert [is_compiled(b) for b in model_blocks(model)] == [True, True, True]
    for block, ref in zip(model_blocks(model), want):
        torch.testing.assert_close(block(x), ref)
    assert sum(counters["graph_break"].values()) > 0


@pytest.mark.parametrize("fullgraph", [True, False])
def test_graph_breaking_blocks_stay_eager_under_fullgraph_only(monkeypatch, fullgraph):
    monkeypatch.setattr(compile_mod, "GRAPH_BREAKING", (BreakingBlock,))
    model = compile_blocks(
        stand_in(Block(), BreakingBlock(), mtp=(BreakingBlock(),)), backend="eager", fullgraph=fullgraph
    )
    assert [is_compiled(b) for b in model_blocks(model)] == [True, not fullgraph, not fullgraph]
    x = torch.randn(2, 4, D)
    for block in model_blocks(model):
        block(x)  # the eager ones do not raise on their break


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_default_static_shapes_compile_one_graph_per_length(dynamic):
    """Three sequence lengths: three static graphs by default (automatic dynamic shapes would compile a dynamic
    graph at the second), fewer when asked for dynamic shapes."""
    kwargs = {} if dynamic is None else dict(dynamic=dynamic)
    block = model_blocks(compile_blocks(stand_in(Block()), backend="eager", **kwargs))[0]
    for T in (3, 4, 5):
        block(torch.randn(2, T, D))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3 if dynamic is None else graphs < 3
