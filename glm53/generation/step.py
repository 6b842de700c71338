"""The generation step: one forward of the model's own blocks on a GenerationCache, for every use.

Legend: B batch, T new positions (the prompt at the prefill, 1 when decoding, k + 1 when verifying k drafts),
D model width.
`step(model, cache, ids)` is the prefill (the first forward on a cache, with its left-padding mask), a decode step
(T = 1), a speculative verify (T = k + 1) and, on an MTP cache (`part="mtp"`, with the hidden states it reads), the
MTP draft. The blocks own the cache paths (model/kda.py, mla.py, indexer.py; the buffers in model/cache.py): no
formula lives here. The host bookkeeping (the capacity check, the position count) runs before and after the
forward, so a step after the prefill reads no host value: `compile=True` is torch.compile of the same forward
(`fullgraph=True`, static shapes; CUDA graphs via mode="reduce-overhead" on a GPU), through public APIs only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import Glm53Error
from ..model.cache import CacheError, GenerationCache
from ..model.context import ForwardContext
from ..model.inputs import check_device


class GenerationError(Glm53Error):
    """A `generate` argument out of range: names the argument and the bad value."""


def forward(
    model,
    cache: GenerationCache,
    ids: torch.Tensor,
    valid: torch.Tensor,
    hidden: torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks on the cache: ids [B, T], valid [B, T] -> the last hidden state [B, T, D] (main: after the final
    norm; mtp: the MTP layer's output h, before shared_head.norm; `hidden` [B, T, D] is what it reads). `embeds`
    [B, T, D]: the inputs' embeddings instead of embedding `ids` (a VL prompt's spliced image features)."""
    embeds = model.model.embed_tokens(ids) if embeds is None else embeds
    ctx = ForwardContext(valid=valid, cache=cache)
    if cache.part == "main":
        return model.model(inputs_embeds=embeds, ctx=ctx)
    return model.mtp.layer_for(1)(hidden, embeds, ctx)


def check_step(model, cache: object, ids: object, hidden: object = None) -> None:
    """A GenerationCache of this model and integer ids [B, T] on the model's device (host-free: values unread)."""
    if not isinstance(cache, GenerationCache):
        raise CacheError(f"the step takes a GenerationCache, got {type(cache).__name__}")
    if not isinstance(ids, torch.Tensor):
        raise CacheError(f"the step takes ids as a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int) or ids.dim() != 2 or ids.shape[1] == 0:
        raise CacheError(
            f"the step takes integer ids [batch, tokens] (torch.long or torch.int32), got {ids.dtype} "
            f"of shape {tuple(ids.shape)}"
        )
    check_device("ids", ids, model.lm_head.weight.device)
    if cache.part == "mtp" and (not isinstance(hidden, torch.Tensor) or hidden.shape[:2] != ids.shape):
        raise CacheError(
            f"an MTP step takes the main model's hidden states [batch, tokens, width] for ids of shape "
            f"{tuple(ids.shape)}"
        )


class Stepper:
    """Runs steps of one model: eager, or (`compile`) the same forward through torch.compile after the prefill."""

    def __init__(self, compile: bool | str | Callable = False) -> None:
        self.compiled = None
        self.graphs = False  # CUDA graphs: a replay overwrites the previous output, so outputs are copied out
        if compile:
            options = compile_options(compile)
            self.graphs = options.get("mode") == "reduce-overhead"
            self.compiled = torch.compile(forward, **options)

    def __call__(
        self,
        model,
        cache: GenerationCache,
        ids: torch.Tensor,
        valid: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids [B, T] (valid: the prefill's padding mask; later steps are tokens) -> hidden [B, T, D]."""
        check_step(model, cache, ids, hidden)
        if valid is None:
            valid = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        elif cache.started:
            cache.check_tokens(valid)
        cache.begin(valid)
        run: Callable = forward if self.compiled is None or not cache.started else self.compiled
        # contiguous inputs: a compiled step is specialised on strides (a sliced prompt would recompile it)
        if embeds is not None:  # (the prefill of a VL prompt: never the compiled path)
            run = forward
        out = run(model, cache, ids.contiguous(), valid, None if hidden is None else hidden.contiguous(), embeds)
        if self.graphs and run is self.compiled:
            out = out.clone()
        cache.end(ids.shape[1])
        return out


def compile_options(compile: bool | str | Callable) -> dict:
    """torch.compile's options for `compile`: True (inductor; CUDA graphs on a GPU), a backend name or a backend
    callable (torch.compile's own `backend` argument)."""
    if compile is True:
        mode = "reduce-overhead" if torch.cuda.is_available() else None
        return dict(fullgraph=True, dynamic=False, mode=mode)
    if callable(compile) or (isinstance(compile, str) and compile in torch.compiler.list_backends(exclude_tags=())):
        return dict(fullgraph=True, dynamic=False, backend=compile)
    raise GenerationError(
        f"compile must be True, False or a torch.compile backend name "
        f"({', '.join(torch.compiler.list_backends(exclude_tags=()))}), got {compile!r}"
    )


def step(
    model,
    cache: GenerationCache,
    ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One eager step (see Stepper)."""
    return _EAGER(model, cache, ids, valid, hidden)


_EAGER = Stepper()

__all__ = ["GenerationError", "Stepper", "compile_options", "forward", "step"]
