"""A frozen base kept in block-scaled FP8 (the release's format, glm53/checkpoint/fp8.py) and dequantised per matmul.

Legend: O rows (out features), I columns (in features), E routed experts, bo x bi the block, go x gi the blocks.
A base weight `w` [O, I] (or fused experts [E, O, I]) is held as float8_e4m3fn `q` (a parameter that needs no
gradient) plus the fp32 buffer `<name>_scale_inv` [go, gi] ([E, go, gi]); w = q * scale per block. Fused gate/up
experts keep the checkpoint's two blocks grids (gate rows, then up rows) stacked: [E, 2 * ceil(I_e / bo), gi].
Linears compute y = x dequant(q, s)^T through `_Fp8Linear`, which saves only q and s for backward and dequantises
again there, so no dequantised copy outlives one matmul. Other readers (the absorbed MLA attention, the expert
kernel, decode plans) get the dequantised weight from `glm53.boundary.as_local` / `local_parts` for the duration
of their call. Adapters, norms, the router, embeddings, the head and the fp32 keep-list stay in training precision.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import fp8 as fp8_format
from ..errors import ConfigError
from ..model.moe import Experts
from .lora import EXPERT_WEIGHTS, install_view

SCALE = fp8_format.SCALE_SUFFIX  # the scale buffer of `<name>` is `<name>_scale_inv`, as on disk


def is_fp8_base(module: nn.Module, name: str) -> bool:
    return getattr(module, name).dtype == fp8_format.FP8_DTYPE


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                      parts: int = 1) -> torch.Tensor:  # fmt: skip
    """q [..., O, I] e4m3, scale [..., parts * go, gi] -> [..., O, I] in `dtype` (one fp32 multiply per element,
    as glm53.checkpoint.fp8.dequantize); `parts` row groups (gate, up) each have their own block grid."""
    if parts > 1:
        qs, ss = q.chunk(parts, dim=-2), scale.chunk(parts, dim=-2)
        return torch.cat([dequantize_blocks(a, b, block, dtype) for a, b in zip(qs, ss)], dim=-2)
    bo, bi = block
    O, I = q.shape[-2:]
    s = scale.float()
    if O % bo == 0 and I % bi == 0:  # whole blocks: a broadcast view, no expanded scale
        blocks = q.float().unflatten(-1, (I // bi, bi)).unflatten(-3, (O // bo, bo))  # [..., go, bo, gi, bi]
        return (blocks * s[..., :, None, :, None]).flatten(-2).flatten(-3, -2).to(dtype)
    full = s.repeat_interleave(bo, -2)[..., :O, :].repeat_interleave(bi, -1)[..., :I]
    return (q.float() * full).to(dtype)


def dequantized(module: nn.Module, name: str, local: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`module.<name>` (FP8, given as `local`) dequantised in the module's compute dtype (or `dtype`)."""
    scale = getattr(module, name + SCALE)
    if local.shape[:-2] != scale.shape[:-2]:
        raise ValueError(f"FP8 base {name} {tuple(local.shape)} with scales {tuple(scale.shape)}: its scales were "
                         "not sharded with it (an FP8 base under expert parallelism is not supported yet)")
    return dequantize_blocks(local, getattr(module, name + SCALE), module.fp8_block,
                             dtype or module.fp8_compute_dtype, module.fp8_parts.get(name, 1))  # fmt: skip


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with W dequantised from (q, scale) here and again in backward (W is frozen: no grad)."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, block):
        ctx.save_for_backward(q, scale)
        ctx.block, ctx.has_bias = block, bias is not None
        return F.linear(x, dequantize_blocks(q, scale, block, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        d_x = grad @ dequantize_blocks(q, scale, ctx.block, grad.dtype) if ctx.needs_input_grad[0] else None
        d_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return d_x, None, None, d_bias, None


def fp8_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The FP8 base linear of `module` on x [..., I] -> [..., O] in x's dtype."""
    return _Fp8Linear.apply(x, module.weight, getattr(module, "weight" + SCALE), module.bias, module.fp8_block)


def set_fp8(module: nn.Module, name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
            compute_dtype: torch.dtype, parts: int = 1) -> None:  # fmt: skip
    """Hold `module.<name>` as FP8 `q` with `scale` (replacing the parameter; no gradient) and route its readers
    through the dequantising view."""
    if q.dtype != fp8_format.FP8_DTYPE:
        raise ConfigError(f"{name}: an FP8 base needs float8_e4m3fn values, got {q.dtype}")
    module.register_parameter(name, nn.Parameter(q, requires_grad=False))
    module.register_buffer(name + SCALE, scale.float())
    module.fp8_block, module.fp8_compute_dtype = tuple(block), compute_dtype
    module.__dict__.setdefault("fp8_parts", {})[name] = parts
    install_view(module, name)


def drop_fp8(module: nn.Module, name: str) -> None:
    """Forget `module.<name>`'s FP8 scale (the caller replaces the parameter)."""
    if hasattr(module, name + SCALE):
        delattr(module, name + SCALE)
        module.fp8_parts.pop(name, None)


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


def quantize_model(model: nn.Module, block: tuple[int, int] = fp8_format.DEFAULT_BLOCK_SIZE,
                   compute_dtype: torch.dtype | None = None) -> list[str]:  # fmt: skip
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


__all__ = ["is_fp8_base", "dequantize_blocks", "dequantized", "fp8_linear", "set_fp8", "drop_fp8", "fp8_modules",
           "quantize_module", "quantize_blocks", "quantize_model", "fp8_bytes"]  # fmt: skip
