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

`fullgraph`: KDA blocks trace as one graph (the KDA chunk kernel and the grouped expert matmul are custom ops,
glm53/kernels/opaque.py). MLA blocks and MTP layers (MLA + MoE) still break the graph in the indexer's pool
selection and the sparse attention's key span (data-dependent shapes) until those kernels become custom ops,
so blocks holding a module in GRAPH_BREAKING are compiled with graph breaks allowed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .mla import MultiHeadLatentAttention

# Modules whose kernels still break a compiled graph; a block holding one compiles with fullgraph=False.
GRAPH_BREAKING: tuple[type[nn.Module], ...] = (MultiHeadLatentAttention,)
BACKENDS = ("inductor", "aot_eager", "eager")  # inductor generates kernels; the others only trace (tests)


def compile_blocks(model: nn.Module, *, backend: str = "inductor", fullgraph: bool | None = None,
                   dynamic: bool | None = None) -> nn.Module:  # fmt: skip
    """Compile the forward of every decoder block and MTP layer of a Glm53ForCausalLM in place -> the model.

    Call it on a single-process model, or inside `glm53.parallel.parallelize(..., compile=True)`, which calls it
    after TP and activation checkpointing and before FSDP. Parameter names and state dicts are unchanged.
    `fullgraph=None`: blocks without MLA compile with fullgraph=True (a graph break raises), MLA blocks allow
    breaks (see the module docstring); False allows breaks everywhere (parallelize passes it when FSDP units are
    nested inside a block: their hooks always run eagerly, so the graph splits around them).
    """
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS}, got {backend!r}")
    for block in model_blocks(model):
        if getattr(block, "_glm53_compiled", False):
            raise RuntimeError(f"{type(block).__name__} is already compiled: call compile_blocks once per model")
        whole = fullgraph if fullgraph is not None else not any(isinstance(m, GRAPH_BREAKING) for m in block.modules())
        # an instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks around it
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=whole, dynamic=dynamic)
        block._glm53_compiled = True
    return model


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks, then the MTP layers, of a Glm53ForCausalLM."""
    mtp = getattr(model, "mtp", None)
    return [*model.model.layers, *(mtp.layers if mtp is not None else [])]


__all__ = ["BACKENDS", "GRAPH_BREAKING", "compile_blocks", "model_blocks"]
