"""`merge_lora_sharded`: glm53.peft's merge_lora on a parallelized model, each rank folding the adapters into its own
shards of the base (for `glm53 train --export-merged` under torchrun, then `export_pretrained`).

Legend: O rows, I columns, E experts, r the adapter rank; a box is one rectangular part of this rank's shard
(pieces.py). For an adapted weight W [O, I] (or [E, O, I]) with factors A [r, I], B [O, r] and scaling s, each box
of this rank's shard of W gets base + s * B[rows] @ A[:, cols], summed in fp32 and cast to `dtype`, as merge_lora
does on one process. The base is widened per box: a bf16-held one cast, an FP8-held one (values or their uint8 bits)
dequantised with the scale blocks the box meets (`dequantize_slice`, partial blocks included); the factors are read
whole, one module at a time (every rank walks the modules in the same order: the gathers are collective).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..checkpoint.fp8 import FP8_DTYPE, SCALE_SUFFIX
from ..peft.views import restore_plain_class
from .load import dequantize_slice
from .pieces import box_slices, global_indices, local_boxes, local_tensor

VIEWS = "_glm53_weight_views"  # glm53.hooks.WEIGHT_VIEWS: the modules glm53.peft gave a view (adapter / held base)
HELD = "held_kinds"  # glm53.peft.fp8.HELD


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _factors(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) whole, or None without an adapter."""
    if hasattr(module, f"{name}_lora_A"):  # fused experts: [E, r, I], [E, O, r]
        return _full(getattr(module, f"{name}_lora_A")).float(), _full(getattr(module, f"{name}_lora_B")).float()
    if name == "weight" and hasattr(module, "lora_A"):
        return _full(module.lora_A.weight).float(), _full(module.lora_B.weight).float()
    return None


def _base_box(module: nn.Module, name: str, local: torch.Tensor, glob: tuple[slice, ...]) -> torch.Tensor:
    """The base values of one box (`local`: its stored values, at global index `glob`) in fp32."""
    if module.__dict__.get(HELD, {}).get(name) != "fp8":
        return local.float()
    q = local.view(FP8_DTYPE) if local.dtype == torch.uint8 else local
    scale = getattr(module, name + SCALE_SUFFIX)
    parts, block = module.fp8_parts.get(name, 1), module.fp8_block
    rows, srows = getattr(module, name).shape[-2] // parts, scale.shape[-2] // parts  # per part (gate, up)
    (r0, r1), (c0, c1) = (glob[-2].start, glob[-2].stop), (glob[-1].start, glob[-1].stop)
    cols = slice(c0 // block[1], -(-c1 // block[1]))  # the scale blocks the box's columns meet
    experts = global_indices(scale, 0) if scale.dim() == 3 else None  # the experts this rank holds scales of
    out = torch.empty(q.shape, dtype=torch.float32)
    for e in range(q.shape[0]) if experts is not None else [None]:
        idx = () if e is None else (e,)
        grid = local_tensor(scale) if e is None else local_tensor(scale)[experts.index(glob[0].start + e)]
        for part in range(parts):
            lo, hi = max(r0, part * rows), min(r1, (part + 1) * rows)
            if lo >= hi:
                continue
            p0, p1 = lo - part * rows, hi - part * rows  # rows inside the part
            blocks = grid[part * srows + p0 // block[0] : part * srows + -(-p1 // block[0]), cols]
            here = idx + (slice(lo - r0, hi - r0),)
            out[here] = dequantize_slice(q[here], blocks, block, (p0, c0))
    return out


def merge_lora_sharded(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Fold every adapter of a parallelized glm53.peft model into its base shards (call on every rank) -> the merged
    module names. Held bases (FP8, bf16) and adapted weights become plain `dtype` parameters with their weight's
    placements; the adapters, scales and views are removed. The model is for export afterwards, not for training."""
    merged = []
    for module_name, module in model.named_modules():
        views = module.__dict__.get(VIEWS)
        if not views:
            continue
        for name in list(views):
            weight = getattr(module, name)
            factors = _factors(module, name)
            held = module.__dict__.get(HELD, {}).get(name)
            local = local_tensor(weight)
            target = dtype if held else weight.dtype
            out = torch.empty(local.shape, dtype=target, device=local.device)
            for box in local_boxes(weight):
                local_idx, glob = box_slices(box)
                value = _base_box(module, name, local[local_idx], glob)
                if factors is not None:
                    A, B = factors
                    lead = glob[:-2]
                    value = value + module.lora_scale * (B[lead + (glob[-2],)] @ A[lead + (slice(None), glob[-1])])
                out[local_idx] = value.to(target)
            if isinstance(weight, DTensor):
                out = DTensor.from_local(
                    out, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride()
                )
            module.register_parameter(name, nn.Parameter(out, requires_grad=False))
            for attr in (f"{name}_lora_A", f"{name}_lora_B", name + SCALE_SUFFIX):
                if hasattr(module, attr):
                    delattr(module, attr)
            if name == "weight":
                for child in ("lora_A", "lora_B"):
                    if child in module._modules:
                        del module._modules[child]
            module.__dict__.get(HELD, {}).pop(name, None)
            del views[name]
        del module.__dict__[VIEWS]
        restore_plain_class(module)
        merged.append(module_name)
    model.__dict__.pop("lora_settings", None)
    return merged


__all__ = ["merge_lora_sharded"]
