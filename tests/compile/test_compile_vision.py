"""compile_vision_blocks: the vision blocks' parts around the segment attention compiled in place (fullgraph,
dynamic rows), forward and every parameter and input gradient equal to eager, on mixed-size images and a video;
a batch of other sizes compiles no new graph; activation checkpointing; a second compile raises.

The graph-counting case runs dynamo's traced graphs as they are (eager ops); "aot_eager" (the checkpointing case)
traces through dynamo and AOT autograd (fake tensors, the joint graph) without generating C++: the
compiled parts then run the same ATen ops as eager, re-ordered only where AOT's decompositions split an op (the
RMSNorm mean, the SwiGLU's clamps). Bound: each of the ~10 elementwise and reduction steps of a block may move a
value by a few fp32 ulps (eps 1.2e-7) relative to its scale, over depth 2 blocks plus the eager merger that
carries it: 8 eps x 10 x depth 2 ~ 2e-5 relative (max |diff| / max |ref|), gradients doubled through the
backward pass (measured here: aot_eager bit-identical, 0). The inductor case (C++ kernels, fused: reductions
re-associated) gets the same bound (measured: 5.7e-7 forward, 1.5e-6 the worst gradient).
"""

from __future__ import annotations

import pytest
import torch

from glm53.model.compile import compile_blocks, compile_vision_blocks
from glm53.vision import Glm53VisionConfig, VisionTower
from tests.helpers.vision import TOWER, pixels, randomize_parameters

EPS = torch.finfo(torch.float32).eps
FWD_REL = 8 * EPS * 10 * TOWER["depth"]  # ~1.9e-5
GRAD_REL = 2 * FWD_REL
FIRST = [(1, 4, 6), (1, 2, 2), (2, 4, 4), (1, 6, 4)]  # mixed-size images and a 2-slice video: 104 rows
SECOND = [(1, 8, 2), (3, 2, 4), (1, 4, 4)]  # other sizes: 56 rows


def tower(seed: int = 0) -> VisionTower:
    t = VisionTower(Glm53VisionConfig.from_dict(TOWER))
    randomize_parameters(t, seed)  # random norms and biases: unit weights and zero biases hide bugs
    return t


def graph_counter():
    """A torch.compile backend (a callable: the public API) that counts the graphs dynamo hands it and runs each as
    traced (autograd through the graph's ops, as eager)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def run(t: VisionTower, grid, seed: int):
    """pooler_output and the gradients of every parameter and of the pixel rows under a fixed cotangent."""
    x, g = pixels(grid, seed=seed)
    x.requires_grad_()
    out = t(x, g).pooler_output
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad((out * cot).sum(), [x, *t.parameters()])
    return out.detach(), grads


def assert_matches(got, want, names):
    out, grads = got
    ref_out, ref_grads = want
    assert rel(out, ref_out) < FWD_REL
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert r.abs().max() > 0, name
        assert rel(g, r) < GRAD_REL, f"{name}: {rel(g, r):.2e}"


def test_compiled_tower_matches_eager_and_a_new_batch_compiles_no_graph():
    torch.compiler.reset()
    eager, compiled = tower(), tower()
    names = ["pixel_values", *(n for n, _ in eager.named_parameters())]
    keys = list(compiled.state_dict())
    backend, graphs = graph_counter()
    compile_vision_blocks(compiled, backend=backend)
    assert list(compiled.state_dict()) == keys  # names unchanged: the blocks' methods are replaced, not wrapped
    assert_matches(run(compiled, FIRST, seed=0), run(eager, FIRST, seed=0), names)
    # two parts, one graph each, shared by both blocks
    assert len(graphs) == len(compiled.blocks[0].COMPILED_PARTS) == 2
    assert_matches(run(compiled, SECOND, seed=7), run(eager, SECOND, seed=7), names)
    assert len(graphs) == 2  # dynamic rows: 56 patches reuse the graphs 104 compiled


def test_compiled_tower_with_activation_checkpointing_matches_eager():
    torch.compiler.reset()
    eager, compiled = tower(seed=1), tower(seed=1)
    compile_vision_blocks(compiled, backend="aot_eager")
    compiled.gradient_checkpointing = True
    compiled.train()
    names = ["pixel_values", *(n for n, _ in eager.named_parameters())]
    assert_matches(run(compiled, FIRST, seed=2), run(eager, FIRST, seed=2), names)


def test_inductor_tower_matches_eager():
    """The one inductor case: generated C++ kernels, forward and backward, one small batch."""
    torch.compiler.reset()
    eager, compiled = tower(seed=2), tower(seed=2)
    compile_vision_blocks(compiled)
    names = ["pixel_values", *(n for n, _ in eager.named_parameters())]
    assert_matches(run(compiled, [(1, 2, 4), (2, 2, 2)], seed=4), run(eager, [(1, 2, 4), (2, 2, 2)], seed=4), names)


def test_compiling_twice_or_a_wrong_argument_raises():
    t = tower()
    compile_vision_blocks(t, backend="eager")
    with pytest.raises(RuntimeError, match="VisionBlock is already compiled: call compile_vision_blocks"):
        compile_vision_blocks(t, backend="eager")
    with pytest.raises(ValueError, match="compile backend must be one of .*got 'tvm'"):
        compile_vision_blocks(tower(), backend="tvm")
    with pytest.raises(TypeError, match="tower must be a VisionTower .*got Linear"):
        compile_vision_blocks(torch.nn.Linear(2, 2), backend="eager")


def test_compile_blocks_compiles_the_vl_models_tower():
    from glm53.vision import with_vision
    from glm53.vision.model import Glm53ForConditionalGeneration
    from tests.helpers.vision import TOKENS, text_config

    model = Glm53ForConditionalGeneration(with_vision(text_config(), TOWER, TOKENS))
    compile_blocks(model, backend="eager")
    for block in model.visual.blocks:
        assert block._glm53_compiled
        assert all(getattr(block, part) is not getattr(type(block), part) for part in block.COMPILED_PARTS)
