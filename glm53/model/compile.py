"""Per-block torch.compile: each decoder block's (and MTP layer's) forward compiled in place.

Legend: B batch, T time, N streams, D model width (glm53/model/__init__.py); blocks map streams [B, T, N, D] to
streams [B, T, N, D].
torchtitan compiles one transformer block at a time (repeated structure: every block of a kind reuses one
compiled graph; the embedding, head and losses stay eager) after tensor parallelism and activation checkpointing
and before FSDP. Here the block's `forward` is replaced by its compiled version instead of wrapping the module
(torch.compile(module) returns an OptimizedModule whose parameter names gain `_orig_mod.`, which the checkpoint
layout, the TP plan and the fp32 keep-list would not match). Module hooks (FSDP's all-gathers, composable
activation checkpointing, the parallel layer's input casts) stay outside the compiled region and run eagerly;
recomputation in backward calls the compiled forward again.

Every block traces as one graph: the kernels with data-dependent control flow or shapes are custom ops (the
KDA chunk kernel, the grouped expert matmul, the sparse attentions and indexer scores, glm53/kernels; the
indexer's pool choice, glm53/model/pool_selection.py `select_pools`), and the indexer's pool axis has a shape-only
size. GRAPH_BREAKING lists module types whose blocks would still break a graph (none now).
Packed documents (`cu_seqlens`) compile per block too: the packed causal conv and indexer scores are custom ops,
the packed pool layout's pool count is a size from the shapes, and the kernels skip their cu_seqlens value checks
while compiling. `cu_seqlens` [n + 1] is a block input: with static shapes each new document count compiles new
graphs. The whole model on a packed `cu_seqlens` batch compiles without a graph break too (forward and
forward+backward, every loss part; tests/compile/test_compile_packed.py): under compile `document_boundaries`
keeps duplicate boundaries as empty documents instead of dropping them with torch.unique and always takes the
packed path (one document per row included), the segment ids count non-empty documents, and the per-document
balance loss sizes its sums by the document count from cu_seqlens' shape. `position_ids` compile without a break
or a recompile per document count (tests/compile/test_compile_position_ids.py): instead of torch.nonzero (whose
count is data) the starts become B * T + 1 boundaries, the starts then empty documents (model/packing.py
`static_boundaries`), and the compiled pool layout holds whole pools only, T // L slots, so the indexer's pool
axis does not grow to T with the B * T documents.
The vision tower (a Glm53ForConditionalGeneration's `visual`, or a VisionTower alone) compiles per block too, with
`compile_vision_blocks` (compile_blocks calls it on a VL model): its segment attention reads the segment sizes on
the host (cu_seqlens.tolist()), so it stays eager and each block's two parts around it (VisionBlock.COMPILED_PARTS:
norm1, qkv, q/k norms and rope; proj, the residuals, norm2 and the clamped SwiGLU) compile as two graphs that every
vision block shares. Their row axis N (patches of the batch) is dynamic: every batch of images has another N, and
a static graph per N would recompile per batch.
A block whose graph breaks is unsafe under activation checkpointing: the forward that compiles it runs part of it
eagerly, the recomputation in backward runs the compiled frames, and the two save different tensors
(torch.utils.checkpoint raises CheckpointError on the first step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

# Modules whose kernels break a compiled graph: a block holding one stays eager under fullgraph=True.
GRAPH_BREAKING: tuple[type[nn.Module], ...] = ()
BACKENDS = ("inductor", "aot_eager", "eager")  # inductor generates kernels; the others only trace (tests)


def compile_blocks(
    model: nn.Module, *, backend: str | Callable = "inductor", fullgraph: bool = True, dynamic: bool | None = False
) -> nn.Module:
    """Compile the forward of the decoder blocks and MTP layers of a Glm53ForCausalLM in place -> the model; on a
    Glm53ForConditionalGeneration also the vision tower's blocks (`compile_vision_blocks`, dynamic rows).

    Call it on a single-process model, or through `glm53.parallel.parallelize(..., compile=True)`, which calls it
    after TP and activation checkpointing and before FSDP. Parameter names and state dicts are unchanged.
    `fullgraph=True`: every block without a GRAPH_BREAKING module compiles as one graph (a break raises); the
    others stay eager. `fullgraph=False`: every block compiles, graph breaks allowed (parallelize uses it when
    FSDP units are nested in a block: their hooks always run eagerly); not with activation checkpointing (see
    the module docstring).
    `dynamic=False` (static shapes: a new sequence length compiles new graphs): with automatic dynamic shapes a
    dynamic graph compiled after a static one can be picked when activation checkpointing recomputes a block
    (the case torch's CheckpointError message describes, pytorch issue 166926).
    """
    _check_backend(backend)
    for block in model_blocks(model):
        _check_not_compiled(block, "compile_blocks once per model")
        if fullgraph and any(isinstance(m, GRAPH_BREAKING) for m in block.modules()):
            continue
        # an instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks around it
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
        block._glm53_compiled = True
    visual = getattr(model, "visual", None)
    if visual is not None:
        compile_vision_blocks(visual, backend=backend, fullgraph=fullgraph)
    return model


def compile_vision_blocks(
    tower: nn.Module, *, backend: str | Callable = "inductor", fullgraph: bool = True, dynamic: bool = True
) -> nn.Module:
    """Compile the parts around the attention of every block of a VisionTower in place -> the tower.

    Each block's COMPILED_PARTS (methods of glm53/vision/block.py VisionBlock) are replaced by their compiled
    versions; `forward` stays eager and runs the segment attention between them, so activation checkpointing
    (VisionTower.gradient_checkpointing, or parallelize's per-block checkpoint) recomputes the same compiled parts.
    Parameter names and state dicts are unchanged. `dynamic=True` (the default): one graph per part for every
    patch count (the row axis is symbolic); `dynamic=False` compiles new graphs for each new patch count.
    `backend`: one of BACKENDS, or a torch.compile backend callable (tests count graphs with one).
    """
    _check_backend(backend)
    blocks = getattr(tower, "blocks", None)
    if blocks is None or not all(hasattr(block, "COMPILED_PARTS") for block in blocks):
        raise TypeError(
            f"compile_vision_blocks: tower must be a VisionTower (blocks with COMPILED_PARTS), got {type(tower).__name__}"
        )
    for block in blocks:
        _check_not_compiled(block, "compile_vision_blocks (or compile_blocks) once per tower")
        for part in block.COMPILED_PARTS:
            setattr(
                block, part, torch.compile(getattr(block, part), backend=backend, fullgraph=fullgraph, dynamic=dynamic)
            )
        block._glm53_compiled = True
    return tower


def _check_backend(backend: str | Callable) -> None:
    if not callable(backend) and backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS} or a callable, got {backend!r}")


def _check_not_compiled(block: nn.Module, advice: str) -> None:
    if getattr(block, "_glm53_compiled", False):
        raise RuntimeError(f"{type(block).__name__} is already compiled: call {advice}")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks, then the MTP layers, of a Glm53ForCausalLM."""
    mtp = getattr(model, "mtp", None)
    return [*model.model.layers, *(mtp.layers if mtp is not None else [])]


__all__ = ["BACKENDS", "GRAPH_BREAKING", "compile_blocks", "compile_vision_blocks", "model_blocks"]
