"""DTensor parameters at the kernel boundary: `materialize_full`, `local_shard` and the resolver behind `as_local`.

Legend: a *boundary* is a place where a glm53 module hands one of its parameters to code that takes plain
tensors (`glm53.hooks.as_local`). What a kernel may receive there depends on the plan, not on the module:
- `Whole(grad_placements)`: the whole parameter (it must be Replicate on every mesh dimension). When the
  activations it meets are sharded on the mesh (KDA's o_norm on head-sharded outputs) its gradient on each
  rank is a partial sum, declared with `grad_placements=[Partial()]` (docs/parallel.md).
- `LocalShard(placements)`: this rank's shard of a parameter sharded exactly like the activations it meets
  (KDA's per-channel convs, dt_bias, A_log); anything else is rejected rather than sliced silently.
Parameters without a registered rule get `Whole()`. Plain tensors always pass through unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ..hooks import set_input_resolver, set_param_resolver, set_value_resolver


class PlacementError(ValueError):
    """A DTensor reached a kernel boundary with placements the kernel cannot take."""


def _describe(t: DTensor) -> str:
    return f"placements {tuple(t.placements)} on mesh {t.device_mesh}"


def materialize_full(t: torch.Tensor, name: str, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """The whole tensor as a plain tensor, for a kernel that takes no DTensors.

    A plain tensor comes back unchanged (the same object). A DTensor that is Replicate on every mesh dimension
    comes back as its local tensor; `grad_placements` says what its gradient is (Partial where the activations
    it meets are sharded). Shard, _StridedShard and Partial raise PlacementError naming `name`: slicing or
    gathering here would give a wrong answer or wrong gradients without a word.
    """
    if not isinstance(t, DTensor):
        return t
    # is_replicate() on every placement: _StridedShard is not a Shard subclass and Partial is not whole.
    if not all(p.is_replicate() for p in t.placements):
        raise PlacementError(
            f"{name}: a kernel needs the whole parameter, but it is a DTensor with {_describe(t)}; only "
            f"Replicate placements can be materialized without communication (shard it in the plan only where "
            f"the kernel is head-local)"
        )
    if grad_placements is not None:
        grad_placements = tuple(grad_placements)
        if len(grad_placements) != t.device_mesh.ndim:
            raise PlacementError(f"{name}: grad_placements {grad_placements} do not match {_describe(t)}")
    return t.to_local(grad_placements=grad_placements)


def local_shard(t: torch.Tensor, name: str, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of a DTensor whose placements must equal `placements` (plain tensors pass through).

    For head-local kernels whose activations are sharded the same way: the local shard's gradient is this
    rank's shard of the full gradient, so it is declared with the same placements.
    """
    if not isinstance(t, DTensor):
        return t
    placements = tuple(placements)
    if tuple(t.placements) != placements:
        raise PlacementError(
            f"{name}: this head-local kernel takes the parameter sharded as {placements} like its activations, "
            f"but it is a DTensor with {_describe(t)}"
        )
    return t.to_local(grad_placements=placements)


@dataclass(frozen=True)
class Whole:
    """Boundary rule: the kernel takes the whole parameter (see `materialize_full`)."""

    grad_placements: tuple[Placement, ...] | None = None

    def __call__(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return materialize_full(t, name, grad_placements=self.grad_placements)


@dataclass(frozen=True)
class LocalShard:
    """Boundary rule: the kernel takes this rank's shard, which must be placed exactly as `placements`.
    `grad_placements`: what its gradient is when not the same (a factor replicated over tp that meets this rank's
    tp shard of another, under ep x tp: (Shard(0), Partial()); glm53/parallel/lora_parallel.py)."""

    placements: tuple[Placement, ...]
    grad_placements: tuple[Placement, ...] | None = None

    def __call__(self, t: torch.Tensor, name: str) -> torch.Tensor:
        local = local_shard(t, name, self.placements)
        if self.grad_placements is None or not isinstance(t, DTensor):
            return local
        return t.to_local(grad_placements=self.grad_placements)


# module -> {parameter name: rule}; module -> its FQN for messages. Weak keys: rules die with the model.
_RULES: "weakref.WeakKeyDictionary[nn.Module, dict[str, Whole | LocalShard]]" = weakref.WeakKeyDictionary()
_NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def set_placement_rule(module: nn.Module, name: str, rule: Whole | LocalShard, fqn: str | None = None) -> None:
    """Declare what `as_local(module, name)` must hand to the kernel when the parameter is a DTensor."""
    if not isinstance(getattr(module, name, None), torch.Tensor):
        raise AttributeError(f"{type(module).__name__} has no parameter {name!r} to set a boundary rule for")
    _RULES.setdefault(module, {})[name] = rule
    if fqn is not None:
        _NAMES[module] = fqn


def name_modules(model: nn.Module) -> None:
    """Remember every submodule's FQN so boundary errors name parameters as the state dict does."""
    for fqn, module in model.named_modules():
        _NAMES[module] = fqn


def placement_rule(module: nn.Module, name: str) -> Whole | LocalShard:
    return _RULES.get(module, {}).get(name, Whole())


def _resolve(module: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return param
    prefix = _NAMES.get(module, type(module).__name__)
    return placement_rule(module, name)(param, f"{prefix}.{name}" if prefix else name)


def plain_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor value that is Replicate on every mesh dimension as its local (whole) tensor; plain tensors pass.

    Its gradient is declared Replicate: every rank computes the same value, so every rank's gradient is whole
    (what the vocab-parallel cross-entropy's backward expects). A sharded or Partial value raises.
    """
    if not isinstance(t, DTensor):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise PlacementError(f"a loss value must be replicated to be used as a plain tensor, got {_describe(t)}")
    return t.to_local(grad_placements=t.placements)


def head_parallel_input(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """`glm53.hooks.into_head_parallel` under DTensor: when `module.<name>` is sharded over the mesh (this rank
    holds some heads), `x` (whole on every rank) gets a Partial gradient, so autograd sums it over the ranks
    (Megatron's "f"); for a plain or replicated parameter `x` passes unchanged."""
    param = getattr(module, name)
    if not isinstance(param, DTensor) or all(p.is_replicate() for p in param.placements):
        return x
    mesh = param.device_mesh
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False).to_local(
        grad_placements=[Partial()] * mesh.ndim
    )


def install() -> None:
    """Route glm53's `as_local`, `as_plain` and `into_head_parallel` through the rules above (no-ops for plain
    tensors: safe to leave on)."""
    set_param_resolver(_resolve)
    set_value_resolver(plain_value)
    set_input_resolver(head_parallel_input)


__all__ = [
    "PlacementError",
    "materialize_full",
    "local_shard",
    "Whole",
    "LocalShard",
    "set_placement_rule",
    "placement_rule",
    "name_modules",
    "install",
    "plain_value",
    "head_parallel_input",
]
