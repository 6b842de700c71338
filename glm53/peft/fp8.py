"""A frozen base held narrower than the training precision, widened per matmul: block-scaled FP8 (the release's
format, glm53/checkpoint/fp8.py) or bf16 (under fp32 training). One mechanism, two storage kinds.

Legend: O rows (out features), I columns (in features), E routed experts, bo x bi the block, go x gi the blocks.
A base weight `w` [O, I] (or fused experts [E, O, I]) is held as float8_e4m3fn `q` (a parameter that needs no
gradient) plus the fp32 buffer `<name>_scale_inv` [go, gi] ([E, go, gi]); w = q * scale per block. Fused gate/up
experts keep the checkpoint's two blocks grids (gate rows, then up rows) stacked: [E, 2 * ceil(I_e / bo), gi].
Linears compute y = x dequant(q, s)^T through `_HeldLinear`, which saves only q and s for backward and dequantises
again there, so no dequantised copy outlives one matmul. Other readers (the absorbed MLA attention, the expert
kernel, decode plans) get the dequantised weight from `glm53.hooks.as_local` / `local_parts` for the duration
of their call. Adapters, norms, the router and the fp32 keep-list stay in training precision (a bf16-held base also
holds the embedding, whose forward widens the rows it gathers, and the head).
A bf16-held base ("bf16" kind) is the same with no scale: w = q.to(compute dtype) (exact: every bf16 value is an fp32
value), so a bf16-held model computes what the fp32 model holding the same values computes, at 2 bytes a weight.
`module.held_kinds` {name: "fp8" | "bf16"} names a module's held weights; `module.held_compute_dtype` is the dtype
the views widen them to (the linears widen to their input's dtype). Under a low-precision FSDP policy FP8 values
are held as their uint8 bits (`hold_for_policy`: the policy casts floating parameters only) and viewed back here.
This file holds the numerics; fp8_storage.py puts a module's base into this form (quantising, or as placeholders).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import fp8 as fp8_format
from ..hooks import as_local
from ..kernels.function import apply

SCALE = fp8_format.SCALE_SUFFIX  # the scale buffer of `<name>` is `<name>_scale_inv`, as on disk


HELD = "held_kinds"  # module.__dict__[HELD]: {parameter name: "fp8" | "bf16"}
HELD_KINDS = ("fp8", "bf16")


def held_kind(module: nn.Module, name: str) -> str | None:
    """ "fp8" or "bf16" when `module.<name>` is a held frozen base, else None (a plain parameter)."""
    return module.__dict__.get(HELD, {}).get(name)


FP8_BITS = (
    torch.uint8
)  # FP8 values held as their bits (`hold_for_policy`): what a low-precision FSDP policy leaves alone


def widen(
    q: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, dtype: torch.dtype, parts: int = 1
) -> torch.Tensor:
    """A held base as a `dtype` tensor: FP8 `q` (or its uint8 bits) dequantised with its block `scale`, or (no scale)
    a bf16 `q` cast."""
    if scale is None:
        return q.to(dtype)
    if q.dtype == FP8_BITS:
        q = q.view(fp8_format.FP8_DTYPE)
    return dequantize_blocks(q, scale, block, dtype, parts)


def dequantize_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, parts: int = 1
) -> torch.Tensor:
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
    """`module.<name>` (a held base, given as `local`) widened to the module's compute dtype (or `dtype`): FP8
    dequantised per block, bf16 cast."""
    dtype = dtype or module.held_compute_dtype
    if held_kind(module, name) == "bf16":
        return widen(local, None, None, dtype)
    scale = as_local(module, name + SCALE)  # this rank's experts' scales under expert parallelism
    if local.shape[:-2] != scale.shape[:-2]:
        raise ValueError(
            f"FP8 base {name} {tuple(local.shape)} with scales {tuple(scale.shape)}: its scales were "
            "not sharded with it"
        )
    return widen(local, scale, module.fp8_block, dtype, module.fp8_parts.get(name, 1))


class _HeldLinear(torch.autograd.Function):
    """y = x W^T + b with W widened from the held (q, scale or None) here and again in backward (W is frozen: no
    grad), so only the held form is saved for backward."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, block):
        ctx.save_for_backward(q, scale)
        ctx.block, ctx.has_bias = block, bias is not None
        return F.linear(x, widen(q, scale, block, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        d_x = grad @ widen(q, scale, ctx.block, grad.dtype) if ctx.needs_input_grad[0] else None
        d_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return d_x, None, None, d_bias, None


def held_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The held base linear of `module` (FP8 or bf16) on x [..., I] -> [..., O] in x's dtype."""
    if held_kind(module, "weight") == "bf16":
        return apply(_HeldLinear, x, module.weight, None, module.bias, None)
    return apply(_HeldLinear, x, module.weight, getattr(module, "weight" + SCALE), module.bias, module.fp8_block)


def hold_for_policy(model: nn.Module, param_dtype: torch.dtype) -> list[str]:
    """Every held base of `model` widened to a low-precision FSDP policy's `param_dtype`, and FP8 values held as
    their uint8 bits (the same bytes; a meta one stays meta) -> the held names. The policy casts floating
    parameters to its param_dtype, which would turn FP8 values into bf16 numbers without their scales; it leaves
    integer ones as they are, so the bits are gathered as they are (1 byte) and dequantised here per matmul."""
    out = []
    for module_name, module in model.named_modules():
        for name, kind in module.__dict__.get(HELD, {}).items():
            param = getattr(module, name)
            if kind == "fp8" and param.dtype == fp8_format.FP8_DTYPE:
                module.register_parameter(name, nn.Parameter(param.detach().view(FP8_BITS), requires_grad=False))
            module.held_compute_dtype = param_dtype
            out.append(f"{module_name}.{name}")
    return out


def drop_held(module: nn.Module, name: str) -> None:
    """Forget that `module.<name>` is held (and its FP8 scale); the caller replaces the parameter."""
    module.__dict__.get(HELD, {}).pop(name, None)
    if hasattr(module, name + SCALE):
        delattr(module, name + SCALE)
        module.fp8_parts.pop(name, None)


__all__ = [
    "SCALE",
    "HELD_KINDS",
    "held_kind",
    "widen",
    "dequantize_blocks",
    "dequantized",
    "held_linear",
    "hold_for_policy",
    "drop_held",
]
