"""LoRA adapters (Hu et al. 2021) on glm53's linears and fused routed experts, freezing, and merging.

Legend: O out features, I in features, r the adapter rank, E routed experts.
An adapted weight W [O, I] computes W x + s * B (A dropout(x)) with A [r, I], B [O, r], s = alpha / r (peft's
scaling); B starts at zero, so an adapted model starts equal to its base. Module names do not change: a linear
keeps `weight` and gains the children `lora_A` (nn.Linear I -> r) and `lora_B` (r -> O), as peft names them; routed
experts [E, O, I] gain `<param>_lora_A` [E, r, I] and `<param>_lora_B` [E, O, r] per fused parameter, run by the
`moe_experts` kernel through its grouped matmuls (kernels/moe.py).
Code that reads a weight itself (the absorbed MLA attention reads kv_b_proj's weight, generation's fused decode
plans, the expert kernel) asks glm53.hooks for it: `as_local` gives base + s * B A, `local_parts` the base and
the low-rank term apart. The per-module views installed here are the only place that knows about adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..hooks import WEIGHT_VIEWS
from ..model.moe import Experts
from ..precision import MODEL_DTYPES
from .fp8 import drop_held, held_kind
from .targets import frozen_parameters, lora_modules
from .views import EXPERT_WEIGHTS, LoraLinear, _linear_parts, install_view, restore_plain_class

LORA_MARK = "lora_"  # every adapter parameter's name contains it


def _check_settings(rank, alpha, dropout) -> float:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"LoRA rank must be a positive int, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError(f"LoRA alpha must be a finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LoRA dropout must be a number in [0, 1), got {dropout!r}")
    return alpha / rank


def _adapter_dtype(module: nn.Module, name: str, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    if held_kind(module, name):  # a held (FP8 / bf16) base: adapters in the precision it is widened to
        return module.held_compute_dtype
    weight = getattr(module, name)
    return weight.dtype if weight.dtype in MODEL_DTYPES else torch.float32


def init_lora_A_(A: torch.Tensor) -> torch.Tensor:
    """Fill an adapter's A factor ([r, I], or [E, r, I] per expert) with peft's default init (kaiming uniform,
    a = sqrt 5), drawing from the global RNG in a fixed order; B factors start at zero. -> A."""
    with torch.no_grad():
        for a in [A] if A.dim() == 2 else A:  # per expert: the same bound as one linear's A
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    return A


def linear_factors(
    in_features: int, out_features: int, rank: int, device, dtype: torch.dtype
) -> tuple[nn.Linear, nn.Linear]:
    """A linear's fresh adapter (lora_A I -> r, lora_B r -> O): A in peft's init, B zero. Built on CPU after the
    same seed, it equals what apply_lora adds (glm53.peft.load.fresh_adapters fills meta-built adapters so)."""
    kw = dict(device=device, dtype=dtype, bias=False)
    A, B = nn.Linear(in_features, rank, **kw), nn.Linear(rank, out_features, **kw)
    init_lora_A_(A.weight)
    with torch.no_grad():
        nn.init.zeros_(B.weight)
    return A, B


def expert_factors(shape: torch.Size, rank: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused expert weight's [E, O, I] fresh adapter: A [E, r, I] in peft's init per expert, B [E, O, r] zero."""
    E, O, I = shape
    A = init_lora_A_(torch.empty(E, rank, I, device=device, dtype=dtype))
    return A, torch.zeros(E, O, rank, device=device, dtype=dtype)


def _add_linear_adapter(module: nn.Linear, rank: int, dtype: torch.dtype | None) -> None:
    module.lora_A, module.lora_B = linear_factors(
        module.in_features, module.out_features, rank, module.weight.device, _adapter_dtype(module, "weight", dtype)
    )
    install_view(module, "weight")


def _add_expert_adapters(module: Experts, rank: int, dtype: torch.dtype | None) -> None:
    chosen = module.__dict__.pop("_lora_params", set(EXPERT_WEIGHTS))
    for name in [n for n in EXPERT_WEIGHTS if n in chosen]:
        weight = getattr(module, name)
        A, B = expert_factors(weight.shape, rank, weight.device, _adapter_dtype(module, name, dtype))
        module.register_parameter(f"{name}_lora_A", nn.Parameter(A))
        module.register_parameter(f"{name}_lora_B", nn.Parameter(B))
        install_view(module, name)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: Iterable[str] | str | None = None,
    *,
    freeze_base: bool = True,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Add LoRA adapters of `rank` (scaling alpha / rank; alpha None means alpha = rank) to the modules `targets`
    select (group names in glm53.peft.targets, or module-name patterns; None: DEFAULT_LORA_TARGETS, groups the
    model lacks skipped) -> the adapted module names.

    freeze_base: every parameter that is not an adapter stops requiring gradients (peft's default); pass False
    and use `freeze(model, groups)` to train some base groups as well. Adapters are in the base weight's dtype
    (for a held FP8 / bf16 base: the dtype it is widened to) unless `dtype` is given. Raises ConfigError for a bad rank/alpha/dropout, a target
    matching nothing, or a model that already has adapters.
    """
    alpha = rank if alpha is None else alpha
    scale = _check_settings(rank, alpha, dropout)
    if has_lora(model):
        raise ConfigError("this model already has LoRA adapters (merge_lora or a fresh model first)")
    chosen = lora_modules(model, targets)
    for module in chosen.values():
        module.lora_scale, module.lora_dropout, module.lora_rank = scale, float(dropout), rank
        if isinstance(module, Experts):
            _add_expert_adapters(module, rank, dtype)
        else:
            _add_linear_adapter(module, rank, dtype)
    model.lora_settings = dict(rank=rank, alpha=alpha, dropout=float(dropout), modules=list(chosen))
    if freeze_base:
        for name, param in model.named_parameters():
            param.requires_grad_(LORA_MARK in name)
    return list(chosen)


def has_lora(model: nn.Module) -> bool:
    return any(LORA_MARK in name for name, _ in model.named_parameters())


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{name: parameter} of every adapter factor."""
    return {n: p for n, p in model.named_parameters() if LORA_MARK in n}


def freeze(model: nn.Module, groups: Iterable[str] | str) -> list[str]:
    """Stop gradients for the parameters of `groups` (names in glm53.peft.targets.FREEZE_GROUPS or module-name
    patterns) -> the frozen names. Frozen parameters get no .grad, so an optimizer built over the parameters that
    require grad (glm53.peft.trainable_parameters) holds no state for them."""
    names = frozen_parameters(model, groups)
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
        params[name].grad = None
    return names


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: those that require gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def merge_lora(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Fold every adapter into its base (W + s B A, summed in fp32) and remove the adapters -> merged module names.

    A held base (FP8 or bf16, glm53.peft.fp8) is widened first and the merged weight is written in `dtype` (bf16 by
    default); other bases keep their dtype. The model afterwards is a plain glm53 model (nn.Linear, no views)."""
    merged = []
    for module_name, module in model.named_modules():
        views = module.__dict__.get(WEIGHT_VIEWS)
        if not views:
            continue
        for name in list(views):
            weight = getattr(module, name)
            target = dtype if held_kind(module, name) else weight.dtype
            with torch.no_grad():
                parts = getattr(views[name], "parts", _linear_parts)
                base, lr = parts(module, weight)
                acc = torch.promote_types(base.dtype, torch.float32)
                effective = base.to(acc) if lr is None else base.to(acc) + lr.delta().to(acc)
            if isinstance(module, Experts):
                for suffix in ("_lora_A", "_lora_B"):
                    if hasattr(module, name + suffix):
                        delattr(module, name + suffix)
            else:
                for child in ("lora_A", "lora_B"):
                    if hasattr(module, child):
                        delattr(module, child)
            drop_held(module, name)
            frozen = weight.requires_grad is False
            module.register_parameter(name, nn.Parameter(effective.to(target), requires_grad=not frozen))
            del views[name]
        del module.__dict__[WEIGHT_VIEWS]
        module.__dict__.pop("_glm53_inference_weights", None)
        restore_plain_class(module)
        for attr in ("lora_scale", "lora_dropout", "lora_rank"):
            module.__dict__.pop(attr, None)
        merged.append(module_name)
    model.__dict__.pop("lora_settings", None)
    return merged


__all__ = [
    "LoraLinear",
    "apply_lora",
    "freeze",
    "merge_lora",
    "has_lora",
    "lora_parameters",
    "trainable_parameters",
    "EXPERT_WEIGHTS",
]
