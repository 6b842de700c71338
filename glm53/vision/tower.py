"""VisionTower (`model.visual` on disk): patch embed -> blocks -> post_layernorm -> downsample -> merger.

Legend: N patch rows, n items (images or videos), m merge size, D tower width, O out width, G = N / m^2.
Input: `pixel_values` [N, C*T*P*P] (row layout (C, T, P, P)) and `grid_thw` int [n, 3] (t, h, w) in patches,
N = sum t*h*w, h and w divisible by m. Attention segments are every temporal slice of every item (cu_seqlens over
h*w repeated t times): an image never sees another, video frames mix only through the patch embedding.
Output: `pooler_output` [G, O] (the merger's output: what replaces the placeholders) and `last_hidden_state`
[G, O] (the downsample output), as transformers' Glm5NextVisionModel returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..errors import InputError
from ..model.norm import RMSNorm
from .block import VisionBlock
from .config import Glm53VisionConfig
from .merger import Downsample, PatchMerger
from .patch_embed import PatchEmbed
from .rotary import axial_cos_sin, patch_positions


@dataclass
class VisionOutput:
    pooler_output: torch.Tensor  # [G, O] merged features, in the items' order
    last_hidden_state: torch.Tensor  # [G, O] downsample output (before the merger)


class VisionTower(nn.Module):
    def __init__(self, config: Glm53VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.downsample = Downsample(config)
        self.merger = PatchMerger(config)
        self.gradient_checkpointing = False  # recompute each block in backward

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        name: str = "pixel_values",
        grid_name: str = "image_grid_thw",
    ) -> VisionOutput:
        """`name` / `grid_name`: how the caller calls the two inputs, for the error messages."""
        grid_thw = check_vision_inputs(pixel_values, grid_thw, self.config, name, grid_name)
        t, h, w = grid_thw.unbind(-1)
        slices = torch.repeat_interleave(h * w, t)  # [segments] one per temporal slice
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(slices, 0), (1, 0))
        rope = axial_cos_sin(
            patch_positions(grid_thw, self.config.spatial_merge_size), self.config.head_dim, self.config.rope_theta
        )
        x = self.patch_embed(pixel_values)  # [N, D]
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cu_seqlens, rope, use_reentrant=False)
            else:
                x = block(x, cu_seqlens, rope)
        hidden = self.downsample(self.post_layernorm(x))  # [G, O]
        return VisionOutput(pooler_output=self.merger(hidden), last_hidden_state=hidden)

    def init_weights(self) -> None:
        """As transformers' _init_weights: normal(initializer_range) weights, zero biases, unit norms."""
        self.patch_embed.init_weights()
        for block in self.blocks:
            block.init_weights()
        self.post_layernorm.init_weights()
        self.downsample.init_weights()
        self.merger.init_weights()


def check_vision_inputs(
    pixel_values: object, grid_thw: object, config: Glm53VisionConfig, name: str, grid_name: str
) -> torch.Tensor:
    """Validate the pixel rows against their grids -> grid_thw as int64 on the pixels' device."""
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
        raise TypeError(
            f"{name} must be a floating torch.Tensor [patches, {config.patch_width}], got "
            f"{getattr(pixel_values, 'dtype', type(pixel_values).__name__)}"
        )
    if pixel_values.dim() != 2 or pixel_values.shape[1] != config.patch_width:
        raise InputError(
            f"{name} must be [patches, C*T*P*P = {config.patch_width}] (in_channels "
            f"{config.in_channels} x temporal_patch_size {config.temporal_patch_size} x patch_size "
            f"{config.patch_size}^2), got shape {tuple(pixel_values.shape)}"
        )
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.is_floating_point() or grid_thw.dtype == torch.bool:
        raise TypeError(
            f"{grid_name} must be an integer torch.Tensor [items, 3] of (t, h, w), got "
            f"{getattr(grid_thw, 'dtype', type(grid_thw).__name__)}"
        )
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise InputError(f"{grid_name} must be [items >= 1, 3] of (t, h, w), got shape {tuple(grid_thw.shape)}")
    rows = grid_thw.tolist()  # NOTE: syncs
    m = config.spatial_merge_size
    for i, (t, h, w) in enumerate(rows):
        if min(t, h, w) < 1:
            raise InputError(f"{grid_name}[{i}] = {(t, h, w)}: t, h and w must be >= 1")
        if h % m or w % m:
            raise InputError(f"{grid_name}[{i}] = {(t, h, w)}: h and w must be divisible by spatial_merge_size {m}")
    patches = sum(t * h * w for t, h, w in rows)
    if patches != pixel_values.shape[0]:
        raise InputError(
            f"{name} has {pixel_values.shape[0]} rows but {grid_name} describes {patches} patches "
            f"(sum of t*h*w over {len(rows)} items)"
        )
    return grid_thw.to(device=pixel_values.device, dtype=torch.long)


def feature_counts(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Merged rows (placeholder tokens) per item: t*h*w / m^2."""
    return [t * h * w // (merge * merge) for t, h, w in grid_thw.tolist()]  # NOTE: syncs


__all__ = ["VisionOutput", "VisionTower", "check_vision_inputs", "feature_counts"]
