"""Names for parts of a model: the LoRA target groups and the freeze groups, and the rule for module-name patterns.

A target (for `apply_lora`) or a freeze group (for `freeze`) is either a group name below or a module-name
pattern; a pattern matches a module whose name equals it, ends with "." + it (peft's `target_modules` rule), or
fully matches it as a regular expression. Groups are decided by module type where glm53 defines the module and
by name where another package does (the vision tower and projector, glm53/vision: `*visual.merger*` and
`*visual.downsample*` are the projector, the rest of `*visual.*` the tower; VISION_NOTES.md).
The MTP layers (`mtp.*`) are in no LoRA group: transformers' model has no MTP module, so adapters there could not be
read by peft; target them by pattern if wanted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch.nn as nn

from ..errors import ConfigError
from ..model.hyper_connection import HyperConnection
from ..model.indexer import Indexer
from ..model.kda import KimiDeltaAttention
from ..model.mla import MultiHeadLatentAttention
from ..model.mlp import MLP
from ..model.moe import Experts, MoE, Router
from ..model.norm import GatedRMSNorm, LayerNorm, RMSNorm

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused expert parameters an adapter can target one by one
_PROJECTOR = re.compile(r"(^|\.)visual\.(merger|downsample)(\.|$)")
_VISION = re.compile(r"(^|\.)visual(\.|$)")


def _parent(model: nn.Module, name: str) -> nn.Module | None:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None


def _in_main(name: str) -> bool:
    return not name.startswith("mtp.")


def _linear_in(kind: type) -> Callable[[nn.Module, str, nn.Module], bool]:
    def test(model: nn.Module, name: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and _in_main(name) and isinstance(_parent(model, name), kind)

    return test


def _dense_mlp(model: nn.Module, name: str, module: nn.Module) -> bool:
    parent = _parent(model, name)
    grand = _parent(model, name.rsplit(".", 1)[0]) if parent is not None else None
    return (
        isinstance(module, nn.Linear)
        and _in_main(name)
        and isinstance(parent, MLP)
        and not isinstance(grand, MoE)
        and not _VISION.search(name)
    )


def _shared_mlp(model: nn.Module, name: str, module: nn.Module) -> bool:
    parent = _parent(model, name)
    return (
        isinstance(module, nn.Linear)
        and _in_main(name)
        and isinstance(parent, MLP)
        and isinstance(_parent(model, name.rsplit(".", 1)[0]), MoE)
    )


# LoRA target groups: module -> whether the group holds it (linears, or fused routed experts).
LORA_GROUPS: dict[str, Callable[[nn.Module, str, nn.Module], bool]] = {
    "mla": _linear_in(MultiHeadLatentAttention),
    "kda": _linear_in(KimiDeltaAttention),
    "indexer": _linear_in(Indexer),
    "mlp": _dense_mlp,
    "shared_experts": _shared_mlp,
    "experts": lambda model, name, m: isinstance(m, Experts) and _in_main(name),
    "projector": lambda model, name, m: isinstance(m, nn.Linear) and bool(_PROJECTOR.search(name)),
}
LORA_ALIASES = {"attention": ("mla", "kda")}
DEFAULT_LORA_TARGETS = ("attention", "mlp", "shared_experts", "experts", "projector")


def _under(kinds: tuple[type, ...]) -> Callable[[nn.Module, str], bool]:
    """A freeze test: the parameter's module or one of its ancestors is one of `kinds`."""

    def test(model: nn.Module, param_name: str) -> bool:
        parts = param_name.split(".")[:-1]
        return any(isinstance(model.get_submodule(".".join(parts[:i])), kinds) for i in range(1, len(parts) + 1))

    return test


# Freeze groups: (model, parameter name) -> whether the group holds the parameter.
FREEZE_GROUPS: dict[str, Callable[[nn.Module, str], bool]] = {
    "embeddings": lambda model, n: n.endswith("embed_tokens.weight"),
    "lm_head": lambda model, n: n == "lm_head.weight" or n.endswith("shared_head.head.weight"),
    "attention": _under((MultiHeadLatentAttention, KimiDeltaAttention)),
    "experts": _under((Experts,)),
    "router": _under((Router,)),
    "mlp": lambda model, n: _under((MLP,))(model, n) and not _VISION.search(n),
    "mHC": _under((HyperConnection,)),
    "norms": lambda model, n: (
        _under((RMSNorm, GatedRMSNorm, LayerNorm))(model, n) or bool(re.search(r"norm[^.]*\.(weight|bias)$", n))
    ),
    "mtp": lambda model, n: n.startswith("mtp."),
    "vision_tower": lambda model, n: bool(_VISION.search(n)) and not _PROJECTOR.search(n),
    "projector": lambda model, n: bool(_PROJECTOR.search(n)),
}


def matches_pattern(name: str, pattern: str) -> bool:
    """peft's `target_modules` rule (exact name or a `.`-suffix) or a full regular-expression match."""
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def _as_names(value: Iterable[str] | str, what: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{what} must be a non-empty list of group names or module-name patterns, got {value!r}")
    return names


def lora_modules(model: nn.Module, targets: Iterable[str] | str | None) -> dict[str, nn.Module]:
    """{module name: module} for every nn.Linear or routed-experts module the targets select (in model order);
    None: DEFAULT_LORA_TARGETS, where a group this model lacks (the projector of a text model) is skipped.

    A routed-experts module is adapted on both fused parameters, or on the ones named as `<module>.<param>`
    (recorded in its `_lora_params`). A target that selects nothing raises ConfigError naming it (and the groups); a pattern that matches a module
    that cannot carry an adapter raises naming the module."""
    chosen: dict[str, nn.Module] = {}
    empty = []
    defaults = targets is None
    for module in model.modules():
        module.__dict__.pop("_lora_params", None)
    for target in _as_names(DEFAULT_LORA_TARGETS if defaults else targets, "targets"):
        groups = LORA_ALIASES.get(target, (target,))
        found = 0
        for name, module in model.named_modules():
            if all(g in LORA_GROUPS for g in groups):
                hit = any(LORA_GROUPS[g](model, name, module) for g in groups)
            else:
                hit = bool(name) and matches_pattern(name, target)
                if hit and not isinstance(module, (nn.Linear, Experts)):
                    raise ConfigError(
                        f"LoRA target {target!r} matches {name!r}, a {type(module).__name__}: adapters "
                        "go on nn.Linear modules and routed experts only"
                    )
            if not hit and isinstance(module, Experts) and "." in target:  # one fused parameter: `<experts>.down_proj`
                prefix, param = target.rsplit(".", 1)
                if param in EXPERT_PARAMS and matches_pattern(name, prefix):
                    module.__dict__.setdefault("_lora_params", set()).add(param)
                    hit = True
            elif hit and isinstance(module, Experts):
                module.__dict__.setdefault("_lora_params", set()).update(EXPERT_PARAMS)
            if hit:
                chosen[name] = module
                found += 1
        if found == 0 and not defaults:
            empty.append(target)
    if not chosen and not empty:
        empty = list(DEFAULT_LORA_TARGETS)
    if empty:
        raise ConfigError(
            f"LoRA targets matching no module of this model: {empty} (groups: "
            f"{sorted([*LORA_GROUPS, *LORA_ALIASES])}, or a module-name pattern)"
        )
    return {n: m for n, m in model.named_modules() if n in chosen}


def frozen_parameters(model: nn.Module, groups: Iterable[str] | str) -> list[str]:
    """Names of the base parameters the freeze groups (or module-name patterns) hold (adapters are never in a
    group). An unknown group name that matches no module raises ConfigError naming it."""
    params = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    out: set[str] = set()
    unknown = []
    for group in _as_names(groups, "freeze groups"):
        if group in FREEZE_GROUPS:
            out.update(n for n in params if FREEZE_GROUPS[group](model, n))
            continue
        hits = {n for n in params if matches_pattern(n.rsplit(".", 1)[0], group) or matches_pattern(n, group)}
        if not hits:
            unknown.append(group)
        out.update(hits)
    if unknown:
        raise ConfigError(
            f"unknown freeze groups {unknown} (groups: {sorted(FREEZE_GROUPS)}, or a module-name "
            "pattern matching some parameter)"
        )
    return [n for n in params if n in out]


__all__ = [
    "LORA_GROUPS",
    "LORA_ALIASES",
    "DEFAULT_LORA_TARGETS",
    "FREEZE_GROUPS",
    "lora_modules",
    "frozen_parameters",
    "matches_pattern",
]
