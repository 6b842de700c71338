"""Holding a module's base in block-scaled FP8 (glm53.peft.fp8's form): from FP8 values, by quantising, counting.

Legend: E routed experts, O rows, I columns (glm53/peft/fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..checkpoint import fp8 as fp8_format
from ..errors import ConfigError
from ..model.moe import Experts
from .fp8 import SCALE
from .views import EXPERT_WEIGHTS, install_view


def set_fp8(
    module: nn.Module,
    name: str,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    compute_dtype: torch.dtype,
    parts: int = 1,
) -> None:
    """Hold `module.<name>` as FP8 `q` with `scale` (replacing the parameter; no gradient) and route its readers
    through the dequantising view."""
    if q.dtype != fp8_format.FP8_DTYPE:
        raise ConfigError(f"{name}: an FP8 base needs float8_e4m3fn values, got {q.dtype}")
    module.register_parameter(name, nn.Parameter(q, requires_grad=False))
    module.register_buffer(name + SCALE, scale.float())
    module.fp8_block, module.fp8_compute_dtype = tuple(block), compute_dtype
    module.__dict__.setdefault("fp8_parts", {})[name] = parts
    install_view(module, name)


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose base a FP8 release stores in FP8: text-model linears except the head (glm53's names:
    `model.*`, `mtp.*`), and routed experts. Vision, embeddings, norms, router, mHC stay as they are."""
    out = {}
    for name, module in model.named_modules():
        text = name.startswith(("model.", "mtp.")) and ".visual." not in f".{name}."
        if text and (isinstance(module, Experts) or isinstance(module, nn.Linear)):
            out[name] = module
    return out


def quantize_module(module: nn.Module, block: tuple[int, int], compute_dtype: torch.dtype) -> None:
    """Quantise a linear's or experts' floating base in place to the release's block format (one scale per block;
    fused gate/up per half, as the checkpoint's per-expert gate and up weights)."""
    names = EXPERT_WEIGHTS if isinstance(module, Experts) else ("weight",)
    for name in names:
        w = getattr(module, name).detach()
        parts = 2 if name == "gate_up_proj" else 1
        q, s = quantize_blocks(w, block, parts)
        set_fp8(module, name, q, s, block, compute_dtype, parts)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., O, I] -> (q e4m3, scale [..., parts * go, gi]) by glm53.checkpoint.fp8.quantize on each matrix."""
    if w.dim() == 2 and parts == 1:
        return fp8_format.quantize(w, block)
    mats = w.reshape(-1, *w.shape[-2:])
    qs, ss = [], []
    for m in mats:  # once, at load
        pq, ps = zip(*(fp8_format.quantize(h, block) for h in m.chunk(parts, dim=0)))
        qs.append(torch.cat(pq, 0))
        ss.append(torch.cat(ps, 0))
    return torch.stack(qs).view(w.shape), torch.stack(ss).view(*w.shape[:-2], *ss[0].shape)


def quantize_model(
    model: nn.Module, block: tuple[int, int] = fp8_format.DEFAULT_BLOCK_SIZE, compute_dtype: torch.dtype | None = None
) -> list[str]:
    """Quantise every `fp8_modules` base of `model` in place (an FP8 base from a bf16/fp32 model) -> names."""
    done = []
    for name, module in fp8_modules(model).items():
        weight = module.gate_up_proj if isinstance(module, Experts) else module.weight
        if weight.dtype == fp8_format.FP8_DTYPE:
            continue
        quantize_module(module, block, compute_dtype or weight.dtype)
        done.append(name)
    return done


def fp8_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes held in FP8 base values, bytes of their scales)."""
    values = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == fp8_format.FP8_DTYPE)
    scales = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(SCALE))
    return values, scales


__all__ = ["set_fp8", "fp8_modules", "quantize_module", "quantize_blocks", "quantize_model", "fp8_bytes"]
