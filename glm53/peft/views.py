"""The per-module weight views glm53.peft installs, and the LoRA linear.

Legend: O out features, I in features, r the adapter rank (glm53/peft/lora.py).
A view answers `glm53.hooks.local_parts(module, name)`: the base weight (widened when it is held in FP8 or bf16,
glm53/peft/fp8.py) and the adapter's low-rank term, or under torch.inference_mode one kept effective weight.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hooks import WEIGHT_VIEWS, LowRank, add_low_rank, as_local
from ..model.moe import Experts
from .fp8 import dequantized, held_kind, held_linear

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # the fused expert parameters [E, O, I]


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA adapter (the class `apply_lora` gives a targeted linear; parameters unchanged).

    The base matmul is the plain one, or the widening one when the base weight is held (FP8 or bf16, glm53.peft.fp8)."""

    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O]
        y = base_linear(self, x)
        if not hasattr(self, "lora_A"):  # a held base without adapter
            return y
        a = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x
        return y + self.lora_B(self.lora_A(a)) * self.lora_scale


class HeldEmbedding(nn.Embedding):
    """An nn.Embedding whose frozen table is held in bf16 (glm53.peft.fp8): the rows are gathered from the held table,
    then widened to the compute dtype (exact: every bf16 value is an fp32 value), so no wide copy of it exists."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, D]
        rows = super().forward(ids)
        return rows.to(self.held_compute_dtype) if held_kind(self, "weight") else rows


def base_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The base weight's matmul: F.linear, or the held base's per-matmul widening one (no resident wide copy)."""
    if held_kind(module, "weight"):
        return held_linear(module, x)
    return F.linear(x, module.weight, module.bias)


def _views(module: nn.Module) -> dict:
    return module.__dict__.setdefault(WEIGHT_VIEWS, {})


def base_weight(module: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """The base of `module.<name>` as a tensor of the compute dtype (held bases widened, glm53.peft.fp8)."""
    return dequantized(module, name, local) if held_kind(module, name) else local


def _inference_view(module: nn.Module, name: str, sources: list[torch.Tensor], parts) -> torch.Tensor:
    """Under torch.inference_mode (generation), the effective weight as ONE kept tensor per (module, name), updated
    in place when a source changed: the decode steps reuse it instead of adding the low-rank term again per token."""
    key = tuple((id(t), t._version) for t in sources)
    kept = module.__dict__.setdefault("_glm53_inference_weights", {})
    hit = kept.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():
        base, low_rank = parts()
        value = base if low_rank is None else add_low_rank(base, low_rank)
        if hit is not None and hit[1].shape == value.shape and hit[1].dtype == value.dtype:
            value = hit[1].copy_(value)  # same storage, version moves: derived plans rebuild
    kept[name] = (key, value)
    return value


def _linear_parts(module: nn.Module, local: torch.Tensor) -> tuple[torch.Tensor, LowRank | None]:
    base = base_weight(module, "weight", local)
    if not hasattr(module, "lora_A"):
        return base, None
    A, B = as_local(module.lora_A, "weight"), as_local(module.lora_B, "weight")
    return base, LowRank(A, B, module.lora_scale, module.lora_dropout if module.training else 0.0)


def _linear_view(module: nn.Module, local: torch.Tensor) -> tuple[torch.Tensor, LowRank | None]:
    if not torch.is_inference_mode_enabled():
        return _linear_parts(module, local)
    sources = [local] + ([module.lora_A.weight, module.lora_B.weight] if hasattr(module, "lora_A") else [])
    return _inference_view(module, "weight", sources, lambda: _linear_parts(module, local)), None


def _expert_view(name: str):
    def parts(module: nn.Module, local: torch.Tensor) -> tuple[torch.Tensor, LowRank | None]:
        base = base_weight(module, name, local)
        if not hasattr(module, f"{name}_lora_A"):
            return base, None
        A, B = as_local(module, f"{name}_lora_A"), as_local(module, f"{name}_lora_B")
        return base, LowRank(A, B, module.lora_scale, module.lora_dropout if module.training else 0.0)

    def view(module: nn.Module, local: torch.Tensor) -> tuple[torch.Tensor, LowRank | None]:
        if not torch.is_inference_mode_enabled():
            return parts(module, local)
        adapters = [getattr(module, f"{name}_lora_{x}") for x in "AB" if hasattr(module, f"{name}_lora_{x}")]
        return _inference_view(module, name, [local, *adapters], lambda: parts(module, local)), None

    view.parts = parts
    return view


def install_view(module: nn.Module, name: str) -> None:
    """Route `as_local(module, name)` / `local_parts` through glm53.peft (adapter and/or FP8 base)."""
    if isinstance(module, Experts):
        _views(module)[name] = _expert_view(name)
    else:
        _views(module)[name] = _linear_view
        module.__class__ = VIEW_CLASSES.get(type(module), type(module))


# the plain module class -> the class install_view gives it (its forward reads the view); merging restores it
VIEW_CLASSES = {nn.Linear: LoraLinear, nn.Embedding: HeldEmbedding}


def restore_plain_class(module: nn.Module) -> None:
    """Undo install_view's class change (a merge folded the view away): LoraLinear -> nn.Linear, HeldEmbedding ->
    nn.Embedding; any other class stays."""
    for plain, viewed in VIEW_CLASSES.items():
        if type(module) is viewed:
            module.__class__ = plain


__all__ = [
    "EXPERT_WEIGHTS",
    "LoraLinear",
    "HeldEmbedding",
    "VIEW_CLASSES",
    "base_linear",
    "base_weight",
    "install_view",
    "restore_plain_class",
]
