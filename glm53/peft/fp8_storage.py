"""Holding a module's frozen base in glm53.peft.fp8's forms: block-scaled FP8 (from FP8 values, or by quantising)
or bf16 (`hold_bf16`), and counting the bytes held.

Legend: E routed experts, O rows, I columns (glm53/peft/fp8.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..checkpoint import fp8 as fp8_format
from ..errors import ConfigError
from ..model.moe import Experts
from .fp8 import HELD, SCALE, held_kind
from .views import EXPERT_WEIGHTS, install_view

WIDE = (torch.float32, torch.float64, torch.bfloat16)  # the dtypes a weight is held in bf16 from


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
    module.fp8_block, module.held_compute_dtype = tuple(block), compute_dtype
    module.__dict__.setdefault("fp8_parts", {})[name] = parts
    module.__dict__.setdefault(HELD, {})[name] = "fp8"
    install_view(module, name)


def set_bf16(module: nn.Module, name: str, compute_dtype: torch.dtype) -> None:
    """Hold the frozen `module.<name>` in bf16 (its values rounded to bf16 once, here: exact for bf16 values; a
    meta parameter stays meta), widened to `compute_dtype` per matmul, and route its readers through the view."""
    param = getattr(module, name)
    if param.requires_grad:
        raise ConfigError(f"{name}: only a frozen weight (no gradient) can be held in bf16")
    module.register_parameter(name, nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False))
    module.held_compute_dtype = compute_dtype
    module.__dict__.setdefault(HELD, {})[name] = "bf16"
    install_view(module, name)


def base_weights(module: nn.Module) -> tuple[str, ...]:
    """The base weight names of an `fp8_modules` module: the fused expert tensors, or a linear's weight."""
    return EXPERT_WEIGHTS if isinstance(module, Experts) else ("weight",)


def hold_bf16(
    model: nn.Module, compute_dtype: torch.dtype = torch.float32, select: Callable[[str], bool] | None = None
) -> list[str]:
    """Hold base weights of the `fp8_modules` set (text linears but the head, routed experts: the weights a FP8
    release stores in FP8) and the text embedding and head (`vocab_tables`) in bf16, widened to the training
    precision `compute_dtype` per matmul (the embedding per gathered row) -> the held names. `select(name)` picks
    them (and freezes them: a held base never trains); None: every frozen one. Trainable weights, FP8-held ones,
    norms, the router, the vision tower and the fp32 keep-list keep their dtype. Works on a meta model (the
    placeholders a loader fills)."""
    held = []
    for module_name, module in {**fp8_modules(model), **vocab_tables(model)}.items():
        for name in base_weights(module):
            full, param = f"{module_name}.{name}", getattr(module, name)
            chosen = not param.requires_grad if select is None else select(full)
            if not chosen or held_kind(module, name) or param.dtype not in WIDE:
                continue
            param.requires_grad_(False)
            set_bf16(module, name, compute_dtype)
            held.append(full)
    return held


def vocab_tables(model: nn.Module) -> dict[str, nn.Module]:
    """The text embedding and lm_head (no FP8 release stores them in FP8; a bf16-held base holds them too), unless
    tied (one parameter in two modules: holding it in one would untie them)."""
    if getattr(model.config, "tie_word_embeddings", False):
        return {}
    out = {}
    for name, module in model.named_modules():
        text = ".visual." not in f".{name}." and ".lora_" not in name
        table = isinstance(module, nn.Embedding) and name.endswith("embed_tokens")
        if text and (table or (name == "lm_head" and isinstance(module, nn.Linear))):
            out[name] = module
    return out


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose base a FP8 release stores in FP8: text-model linears except the head (glm53's names:
    `model.*`, `mtp.*`), and routed experts. Vision, embeddings, norms, router, mHC and adapters stay as they are."""
    out = {}
    for name, module in model.named_modules():
        text = name.startswith(("model.", "mtp.")) and ".visual." not in f".{name}." and ".lora_" not in name
        if text and (isinstance(module, Experts) or isinstance(module, nn.Linear)):
            out[name] = module
    return out


def quantize_module(module: nn.Module, block: tuple[int, int], compute_dtype: torch.dtype) -> None:
    """Quantise a linear's or experts' floating base in place to the release's block format (one scale per block;
    fused gate/up per half, as the checkpoint's per-expert gate and up weights)."""
    for name in base_weights(module):
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


def held_parameters(model: nn.Module, kind: str) -> dict[str, nn.Parameter]:
    """{name: parameter} of the base weights held as `kind` ("fp8" or "bf16")."""
    out = {}
    for module_name, module in model.named_modules():
        for name, k in module.__dict__.get(HELD, {}).items():
            if k == kind:
                out[f"{module_name}.{name}" if module_name else name] = getattr(module, name)
    return out


__all__ = [
    "set_fp8",
    "set_bf16",
    "hold_bf16",
    "fp8_modules",
    "vocab_tables",
    "base_weights",
    "quantize_module",
    "quantize_blocks",
    "quantize_model",
    "fp8_bytes",
    "held_parameters",
]
