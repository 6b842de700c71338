"""The generation step: one forward of the model's own blocks on a GenerationCache, for every use.

Legend: B batch, T new positions (the prompt at the prefill, 1 when decoding, k + 1 when verifying k drafts),
D model width.
`step(model, cache, ids)` is the prefill (the first forward on a cache, with its left-padding mask), a decode step
(T = 1), a speculative verify (T = k + 1) and, on an MTP cache (`part="mtp"`, with the hidden states it reads), the
MTP draft. The blocks own the cache paths (model/kda.py, mla.py, indexer.py; the buffers in model/cache.py): no
formula lives here. The host bookkeeping (the capacity check, the position count) runs before and after the
forward, so a step after the prefill reads no host value: `compile=True` is torch.compile of the same forward
(`fullgraph=True`, static shapes; CUDA graphs on a GPU, inductor's C++ wrapper on a CPU, no guards on nn modules:
`compile_options`), through public APIs only. Each model and static signature compiles its own copy of the forward
(`compiled_forward`), so torch.compile's per-function recompile limit never counts several models or cache lengths
together.
"""

from __future__ import annotations

import types
import weakref
from collections import OrderedDict
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


# Compiled steps, per model: {options: {signature: compiled forward}}. torch.compile keeps its graphs per code object
# and refuses a ninth recompile of one (its recompile limit, 8 by default; with fullgraph=True a hard error). Every
# model and static shape (batch, step length, cache length, part) is one graph, so one shared `forward` would fail
# after a few models or prompt lengths in one process. Each signature compiles its own copy of `forward` instead
# (a new code object, the same function), kept while the model lives, the MAX_SIGNATURES most recent per model.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_SIGNATURES = 32
CAPACITY_BUCKET = 256  # compiled generation sizes its cache in these steps (Stepper.capacity)


def _signature(cache: GenerationCache, ids: torch.Tensor, hidden: torch.Tensor | None, state: int) -> tuple:
    """What a compiled step's static shapes depend on: the part, the batch and step length, the buffers' length;
    and `state`, the model's module state (see module_state)."""
    return (cache.part, tuple(ids.shape), ids.dtype, cache.capacity, None if hidden is None else hidden.dtype, state)


# Module states seen, per model: {module_state(model): a small id}. The id goes into each step's signature (hashing
# the whole state on every step would cost more than the guards it stands for).
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_state(model) -> tuple:
    """What torch.compile's guards on nn modules would check, read once per `generate` call: every module's class,
    training flag and public attributes (numerics settings such as MultiHeadLatentAttention.absorb, the layer kinds,
    the config) and every parameter's and buffer's dtype, device, shape and strides. The compiled step skips those guards
    (torch.compiler.skip_guard_on_all_nn_modules_unsafe: about a tenth of a CPU decode step); a model whose state
    differs from a compiled signature's gets its own graph instead of a stale one. Parameter VALUES are never part of
    it: they are graph inputs, read afresh by every call."""
    modules = tuple(
        (name, type(m), m.training, tuple((k, _attribute_state(v)) for k, v in vars(m).items() if k[0] != "_"))
        for name, m in model.named_modules()
    )
    tensors = tuple(
        (name, _attribute_state(t))
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    )
    return modules, tensors


def _attribute_state(value) -> object:
    """A tensor's dtype, device, shape and strides (never its values); a plain value itself; anything else (a
    config object) its repr."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, tuple(value.shape), value.stride())
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return value
    return repr(value)


def state_id(model) -> int:
    """A small id of `model`'s module_state (equal states, equal ids)."""
    states = _STATES.setdefault(model, {})
    return states.setdefault(module_state(model), len(states))


def _options_key(options: dict) -> tuple:
    """A hashable key of torch.compile keyword arguments (its `options` is a dict)."""
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in options.items()))


def compiled_forward(model, options: dict, signature: tuple) -> Callable:
    """torch.compile(forward, **options) for `model` at `signature`: its own code object, so its own graph cache."""
    per_options = _COMPILED.setdefault(model, {}).setdefault(_options_key(options), OrderedDict())
    if signature in per_options:
        per_options.move_to_end(signature)
        return per_options[signature]
    copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, forward.__defaults__)
    # torch.compile pops guard_filter_fn from its `options` dict: each call gets its own copy
    kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in options.items()}
    per_options[signature] = torch.compile(copy, **kwargs)
    if len(per_options) > MAX_SIGNATURES:
        per_options.popitem(last=False)
    return per_options[signature]


class Stepper:
    """Runs steps of one model: eager, or (`compile`) the same forward through torch.compile after the prefill."""

    def __init__(self, compile: bool | str | Callable = False) -> None:
        self.options = compile_options(compile) if compile else None
        # CUDA graphs: outputs live in the graph's pool and are copied out
        self.graphs = bool(compile) and self.options.get("options", {}).get("triton.cudagraphs", False)
        self._states: dict[int, int] = {}  # id(model) -> state_id, read once: a Stepper serves one generate call

    def capacity(self, positions: int) -> int:
        """The cache length for a call that needs `positions`: exact when eager; compiled, rounded up to a multiple
        of CAPACITY_BUCKET, since every cache length is its own graph (a signature): calls whose prompt plus
        max_new_tokens fall in one bucket reuse one compile instead of compiling again (tens of seconds on a CPU).
        The spare positions are never read (the step masks past the cache's length)."""
        if self.options is None:
            return positions
        return -(-positions // CAPACITY_BUCKET) * CAPACITY_BUCKET

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
        run: Callable = forward
        if self.options is not None and cache.started and embeds is None:  # (a VL prompt's prefill: never compiled)
            if id(model) not in self._states:
                self._states[id(model)] = state_id(model)
            run = compiled_forward(model, self.options, _signature(cache, ids, hidden, self._states[id(model)]))
        out = run(model, cache, _dense(ids), valid, None if hidden is None else _dense(hidden), embeds)
        if self.graphs and run is not forward:
            out = out.clone()
        cache.end(ids.shape[1])
        return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` with row-major strides. A compiled step is specialised on exact strides, and a slice such as the draft's
    h[:, -1:] of a [B, T, D] output is contiguous (`contiguous()` returns it as is) with T-dependent strides: each T
    would compile the step again, until torch.compile's recompile limit fails the call."""
    return t if t.stride() == _row_major(t.shape) else t.clone(memory_format=torch.contiguous_format)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def compile_options(compile: bool | str | Callable) -> dict:
    """torch.compile's options for `compile`: True (inductor; CUDA graphs on a GPU: mode="reduce-overhead", which is
    inductor's triton.cudagraphs option), a backend name or a backend callable (torch.compile's own `backend`
    argument). Every form skips the guards on nn modules (public: torch.compiler.skip_guard_on_all_nn_modules_unsafe;
    they cost about 0.4 ms of a 4 ms CPU decode step on the bench config): the signature carries the model's
    module_state instead, checked once per generate call."""
    skip = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if compile is True:
        # a GPU replays the step as a CUDA graph; a CPU runs it through inductor's C++ wrapper, which calls the
        # kernels without the Python output code's per-call glue (view and stride checks: ~0.6 ms of a 3.7 ms
        # bench-config decode step; its first compile takes about twice as long)
        extra = {"triton.cudagraphs": True} if torch.cuda.is_available() else {"cpp_wrapper": True}
        return dict(fullgraph=True, dynamic=False, options={**skip, **extra})
    if callable(compile) or (isinstance(compile, str) and compile in torch.compiler.list_backends(exclude_tags=())):
        return dict(fullgraph=True, dynamic=False, backend=compile, options=skip)
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

__all__ = [
    "CAPACITY_BUCKET",
    "GenerationError",
    "MAX_SIGNATURES",
    "Stepper",
    "compile_options",
    "compiled_forward",
    "forward",
    "module_state",
    "step",
]
