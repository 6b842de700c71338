"""Tiny vision towers and VL models for the vision tests, built beside transformers' glm5_next oracle.

`TOWER` is a tower small enough for CPU tests but with every feature that matters: 2 blocks, 2 heads of width 8
(the axial rope needs a multiple of 4), patch 2 (C*T*P*P = 24 values per row), merge 2, swiglu_limit 1.5 so that the
clamps bite on randomised weights. Parameters only are randomised (never transformers' rope buffers).
"""

from __future__ import annotations

import math

import torch

TOWER = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=36,
             projection_intermediate_size=20, patch_size=2, temporal_patch_size=2, in_channels=3,
             spatial_merge_size=2, swiglu_limit=1.5)  # fmt: skip
# ids inside the tiny text vocabularies (320): placeholders and span markers
TOKENS = dict(image_token_id=300, video_token_id=301, image_start_token_id=302, image_end_token_id=303,
              video_start_token_id=304, video_end_token_id=305)  # fmt: skip


def randomize_parameters(module: torch.nn.Module, seed: int = 0) -> None:
    """Every floating parameter: norm weights 1 + 0.3 r, biases 0.3 r, matrices r / sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1 and name.endswith("weight"):
                value = 1 + 0.3 * r
            elif p.dim() == 1:
                value = 0.3 * r
            else:
                value = r * (2.0 / math.sqrt(p[0].numel()))
            p.copy_(value.to(p.dtype))


def hf_tower(seed: int = 0, **overrides):
    from transformers import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    config = Glm5NextVisionConfig(**{**TOWER, **overrides})
    config._attn_implementation = "eager"
    tower = Glm5NextVisionModel(config).eval()
    randomize_parameters(tower, seed)
    return tower


def our_tower(hf, dtype=torch.float32):
    from glm53.vision import Glm53VisionConfig, VisionTower

    config = Glm53VisionConfig.from_dict(hf.config.to_dict())
    tower = VisionTower(config)
    tower.load_state_dict(hf.state_dict(), strict=True)
    return tower.to(dtype).eval()


def pixels(grid: list[tuple[int, int, int]], width: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grid, dtype=torch.long)
    n = int(grid_thw.prod(-1).sum())
    return torch.randn(n, width, generator=gen), grid_thw
