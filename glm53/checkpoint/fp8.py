"""Block-scaled FP8 (e4m3) weights as the GLM-5.3 FP8 release stores them (DeepSeek-V3 format).

Legend (local lowercase letters): o rows (out features), i columns (in features), bo x bi the block size
(`weight_block_size`, default 128 x 128), go x gi the number of blocks. A 2-D weight `w` [o, i] is stored as
float8_e4m3fn `q` [o, i] plus fp32 `<name>_scale_inv` `s` [ceil(o/bo), ceil(i/bi)]; edge blocks are partial.
Dequantisation (docs/checkpoints.md, "FP8"):

    w[r, c] = q[r, c] * s[r // bo, c // bi]

`dequantize_reference` is the per-block loop the vectorised `dequantize` is tested against (bit-exact: both
do one fp32 multiply per element). `quantize` is its inverse up to e4m3 rounding; the library uses it only to
synthesise FP8 checkpoints (tests, tools), the release is quantised upstream.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError
from ..utils import ceil_div

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DEFAULT_BLOCK_SIZE = (128, 128)  # the release's weight_block_size
SCALE_SUFFIX = "_scale_inv"  # companion of `<name>`: `<name>_scale_inv`


def is_fp8(dtype: torch.dtype | str) -> bool:
    """True for float8_e4m3fn given as a torch dtype or a safetensors dtype string ("F8_E4M3")."""
    return dtype == FP8_DTYPE or dtype == "F8_E4M3"


def weight_block_size(quantization_config: dict[str, Any] | None) -> tuple[int, int]:
    """`quantization_config["weight_block_size"]` as (bo, bi); 128 x 128 when absent."""
    if quantization_config is not None and not isinstance(quantization_config, dict):
        raise ConfigError(f"quantization_config must be a dict, got {quantization_config!r}")
    block = (quantization_config or {}).get("weight_block_size") or DEFAULT_BLOCK_SIZE
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of `<name>_scale_inv` for a 2-D weight of `shape`: [ceil(o/bo), ceil(i/bi)]."""
    if len(shape) != 2:
        raise ValueError(f"block-scaled FP8 weights are 2-D, got shape {tuple(shape)}")
    return ceil_div(shape[0], block_size[0]), ceil_div(shape[1], block_size[1])


def check_scale(
    key: str, weight_shape: tuple[int, ...], scale_shape_found: tuple[int, ...] | None, block_size: tuple[int, int]
) -> None:
    """Raise ValueError naming `key` when its scale is missing or mis-shaped."""
    if scale_shape_found is None:
        raise ValueError(f"FP8 tensor {key!r} has no {key + SCALE_SUFFIX!r} companion")
    if len(weight_shape) != 2:
        raise ValueError(f"FP8 tensor {key!r} must be 2-D for block scaling, got shape {tuple(weight_shape)}")
    expected = scale_shape(weight_shape, block_size)
    if tuple(scale_shape_found) != expected:
        raise ValueError(
            f"{key + SCALE_SUFFIX!r} has shape {tuple(scale_shape_found)}, expected {expected} for weight "
            f"{tuple(weight_shape)} with weight_block_size {list(block_size)}"
        )


def _expand(scale_inv: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """[ceil(o/bo), ceil(i/bi)] -> [o, i]: each scale repeated over its block, edge blocks cropped."""
    bo, bi = block_size
    return scale_inv.float().repeat_interleave(bo, 0)[: shape[0]].repeat_interleave(bi, 1)[:, : shape[1]]


def dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q [o, i] (e4m3), scale_inv [ceil(o/bo), ceil(i/bi)] -> weight [o, i] in `dtype` (product in fp32)."""
    check_scale("weight", tuple(q.shape), tuple(scale_inv.shape), block_size)
    return (q.float() * _expand(scale_inv, tuple(q.shape), block_size)).to(dtype)


def dequantize_reference(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Loop over blocks: out[block (r, c)] = q[block] * scale_inv[r, c], computed in fp32."""
    check_scale("weight", tuple(q.shape), tuple(scale_inv.shape), block_size)
    bo, bi = block_size
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(scale_inv.shape[0]):
        for c in range(scale_inv.shape[1]):
            rows, cols = slice(r * bo, (r + 1) * bo), slice(c * bi, (c + 1) * bi)
            out[rows, cols] = q[rows, cols].float() * scale_inv[r, c].float()
    return out.to(dtype)


def quantize(
    weight: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [o, i] -> (q [o, i] e4m3, scale_inv [ceil(o/bo), ceil(i/bi)] fp32), one scale per block.

    scale_inv = amax(|block|) / FP8_MAX, so every block's largest entry maps to +-448 (all-zero blocks get 1).
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {tuple(weight.shape)}")
    bo, bi = block_size
    rows, cols = weight.shape
    go, gi = scale_shape((rows, cols), block_size)
    padded = torch.zeros(go * bo, gi * bi, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(go, bo, gi, bi)
    amax = blocks.abs().amax(dim=(1, 3))  # [go, gi]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (weight.float() / _expand(scale_inv, (rows, cols), block_size)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv
