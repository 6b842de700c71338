"""The kernel boundary: where a module hands one of its own parameters to code that takes plain tensors.

Modules read such a parameter as `as_local(self, "weight")`, never as `self.weight`. On one process (and inside
FSDP, whose unsharded parameters are plain tensors) this is the parameter itself. Under tensor parallelism the
parameter is a DTensor; `glm53.parallel` installs a resolver with `set_param_resolver` that returns the plain
tensor the kernel expects after checking the DTensor's placements against the parallel plan (whole parameter,
or this rank's shard for head-local parameters), and raises naming the parameter otherwise. This keeps
`torch.distributed` out of model code (docs/style.md: parallelism lives in `glm53/parallel/`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn

# (module, attribute name, parameter) -> plain tensor; None means "return the parameter unchanged".
ParamResolver = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]
_RESOLVER: ParamResolver | None = None
# A value every rank holds whole (a replicated DTensor loss) -> plain tensor; None means "unchanged".
ValueResolver = Callable[[torch.Tensor], torch.Tensor]
_VALUE_RESOLVER: ValueResolver | None = None
# Experts module -> the function that runs it across ranks, or None to call the kernel locally.
ExpertDispatcher = Callable[[nn.Module], Callable | None]
_EXPERT_DISPATCHER: ExpertDispatcher | None = None


class LowRank(NamedTuple):
    """A low-rank term beside a weight W: the effective weight is W + scale * B @ A (LoRA, glm53.peft).

    2-D weight [O, I]: A [r, I], B [O, r]; fused experts [E, O, I]: A [E, r, I], B [E, O, r]. `dropout` is the
    probability applied to the low-rank path's input (0 outside training)."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    dropout: float = 0.0

    def delta(self) -> torch.Tensor:
        """scale * B @ A, [O, I] or [E, O, I] (fp32 product when the factors are fp32)."""
        return torch.matmul(self.B, self.A) * self.scale


# A module whose weight is more than its stored parameter (a LoRA adapter beside it, an FP8 base with block
# scales; glm53.peft installs both) holds, under this attribute, {parameter name: view}; a view maps
# (module, the stored tensor resolved as below) -> (the base weight as a plain floating tensor, LowRank or None).
WEIGHT_VIEWS = "_glm53_weight_views"
WeightView = Callable[[nn.Module, torch.Tensor], "tuple[torch.Tensor, LowRank | None]"]


def local_parts(module: nn.Module, name: str) -> tuple[torch.Tensor, LowRank | None]:
    """`module.<name>` as (base weight, low-rank term or None): for code that runs the low-rank term itself (the
    LoRA linear, the routed experts' grouped kernel). Everything else reads `as_local`, which adds the two."""
    param = getattr(module, name)
    local = param if _RESOLVER is None else _RESOLVER(module, name, param)
    view = module.__dict__.get(WEIGHT_VIEWS, {}).get(name)
    return (local, None) if view is None else view(module, local)


def compute_dtype(module: nn.Module, name: str) -> torch.dtype:
    """The dtype `module.<name>` computes in: the parameter's, or for a base glm53.peft holds narrower (bf16 / FP8)
    the dtype its view widens it to."""
    if name in module.__dict__.get("held_kinds", {}):  # glm53.peft.fp8.HELD
        return module.held_compute_dtype
    return getattr(module, name).dtype


def as_local(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` as the plain tensor a kernel can take (the parameter itself on one process); with an
    adapter or a compressed base (glm53.peft) the effective weight: base (dequantised) + scale * B @ A."""
    base, low_rank = local_parts(module, name)
    if low_rank is None:
        return base
    return add_low_rank(base, low_rank)


def add_low_rank(base: torch.Tensor, low_rank: LowRank) -> torch.Tensor:
    """base + scale * B @ A, summed in fp32 (fp64 for an fp64 base) and returned in base's dtype."""
    acc = torch.promote_types(base.dtype, torch.float32)
    return (base.to(acc) + low_rank.delta().to(acc)).to(base.dtype)


def set_param_resolver(resolver: ParamResolver | None) -> ParamResolver | None:
    """Install the resolver `as_local` uses (None removes it); returns the previous one."""
    global _RESOLVER
    previous, _RESOLVER = _RESOLVER, resolver
    return previous


def expert_dispatcher(module: nn.Module) -> Callable | None:
    """The function that runs `module`'s routed experts when the parallel layer spreads them over ranks
    (expert parallelism: tokens sent to the ranks holding their experts and back), with the `moe_experts`
    kernel's signature; None on one process, where the module calls the kernel itself."""
    return None if _EXPERT_DISPATCHER is None else _EXPERT_DISPATCHER(module)


def set_expert_dispatcher(dispatcher: ExpertDispatcher | None) -> ExpertDispatcher | None:
    """Install the lookup `expert_dispatcher` uses (None removes it); returns the previous one."""
    global _EXPERT_DISPATCHER
    previous, _EXPERT_DISPATCHER = _EXPERT_DISPATCHER, dispatcher
    return previous


# Head module -> the function computing its head + cross-entropy when the parallel layer shards its vocabulary,
# or None where the head's weight is whole.
VocabParallelLoss = Callable[[nn.Module], Callable | None]
_VOCAB_PARALLEL_LOSS: VocabParallelLoss | None = None


def vocab_parallel_loss(module: nn.Module) -> Callable | None:
    """For a head whose vocabulary rows the parallel layer spread over ranks (tensor parallelism), the function
    (hidden [M, D], targets [M]) -> the fp32 sum over target tokens of -log softmax(hidden W^T)[target] (the
    `linear_cross_entropy` kernel's result, without its weight argument), which combines the ranks' softmax
    statistics; None on one process, where the caller hands the whole weight to the kernel."""
    return None if _VOCAB_PARALLEL_LOSS is None else _VOCAB_PARALLEL_LOSS(module)


def set_vocab_parallel_loss(lookup: VocabParallelLoss | None) -> VocabParallelLoss | None:
    """Install the lookup `vocab_parallel_loss` uses (None removes it); returns the previous one."""
    global _VOCAB_PARALLEL_LOSS
    previous, _VOCAB_PARALLEL_LOSS = _VOCAB_PARALLEL_LOSS, lookup
    return previous


# (module, attribute name, activation) -> the activation, marked so its gradient is summed over the ranks that
# share `module.<name>`'s heads; None means "unchanged".
InputResolver = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]
_INPUT_RESOLVER: InputResolver | None = None


def into_head_parallel(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """`x`, which every rank holds whole, as the input of a computation over this rank's heads of
    `module.<name>` (the absorbed MLA reads the shared latent with its local heads). On one process `x` itself;
    under tensor parallelism its gradient is a partial sum over the ranks' heads, which the parallel layer sums."""
    return x if _INPUT_RESOLVER is None else _INPUT_RESOLVER(module, name, x)


def set_input_resolver(resolver: InputResolver | None) -> InputResolver | None:
    """Install the resolver `into_head_parallel` uses (None removes it); returns the previous one."""
    global _INPUT_RESOLVER
    previous, _INPUT_RESOLVER = _INPUT_RESOLVER, resolver
    return previous


def as_plain(value: torch.Tensor) -> torch.Tensor:
    """A computed value that every rank holds whole (the vocab-parallel cross-entropy's replicated DTensor loss)
    as a plain tensor, so it can be added to losses computed from plain activations (router balance, indexer KL);
    the value itself on one process."""
    return value if _VALUE_RESOLVER is None else _VALUE_RESOLVER(value)


def set_value_resolver(resolver: ValueResolver | None) -> ValueResolver | None:
    """Install the resolver `as_plain` uses (None removes it); returns the previous one."""
    global _VALUE_RESOLVER
    previous, _VALUE_RESOLVER = _VALUE_RESOLVER, resolver
    return previous


__all__ = [
    "as_local",
    "compute_dtype",
    "local_parts",
    "add_low_rank",
    "LowRank",
    "WEIGHT_VIEWS",
    "as_plain",
    "into_head_parallel",
    "set_input_resolver",
    "set_param_resolver",
    "set_value_resolver",
    "expert_dispatcher",
    "set_expert_dispatcher",
    "vocab_parallel_loss",
    "set_vocab_parallel_loss",
]
