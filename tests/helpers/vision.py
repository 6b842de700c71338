"""Tiny vision towers and VL models for the vision tests, built beside transformers' glm5_next oracle.

`TOWER` is a tower small enough for CPU tests but with every feature that matters: 2 blocks, 2 heads of width 8
(the axial rope needs a multiple of 4), patch 2 (C*T*P*P = 24 values per row), merge 2, swiglu_limit 1.5 so that the
clamps bite on randomised weights. Parameters only are randomised (never transformers' rope buffers).
"""

from __future__ import annotations

import math

import torch

TOWER = dict(
    depth=2,
    hidden_size=16,
    num_heads=2,
    intermediate_size=24,
    out_hidden_size=36,
    projection_intermediate_size=20,
    patch_size=2,
    temporal_patch_size=2,
    in_channels=3,
    spatial_merge_size=2,
    swiglu_limit=1.5,
)
# ids inside the tiny text vocabularies (320): placeholders and span markers
TOKENS = dict(
    image_token_id=300,
    video_token_id=301,
    image_start_token_id=302,
    image_end_token_id=303,
    video_start_token_id=304,
    video_end_token_id=305,
)


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


def text_config(**overrides):
    """The checkpoint tests' tiny text model (KDA, MLA full + shared, MoE), width 36 = TOWER's out_hidden_size."""
    from tests.helpers.checkpoints import tiny_config

    base = tiny_config(**overrides)
    return type(base).from_dict(base.to_dict())  # text only: the helper's outer vision_config dropped


def hf_vl_model(config, seed: int = 0, **tower):
    """transformers' Glm5NextForConditionalGeneration over the text `config` with TOWER and TOKENS, randomised:
    the text model as the oracle helper does (every text parameter and buffer), the tower's parameters only."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.helpers.oracle import hf_text_kwargs, randomize

    hf_config = Glm5NextConfig(
        text_config=hf_text_kwargs(config),
        vision_config={**TOWER, **tower},
        **TOKENS,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    for c in (hf_config, hf_config.text_config, hf_config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hf_config).eval()
    randomize(model.model.language_model, seed)
    randomize(model.lm_head, seed + 1)
    randomize_parameters(model.model.visual, seed + 2)
    return model


def our_vl_model(hf):
    from glm53 import Glm53ForConditionalGeneration

    return Glm53ForConditionalGeneration.from_transformers(hf).eval()


def vl_batch(rows: list[list], merge: int = 2, seed: int = 0) -> dict:
    """Token rows from items: ints are text ids, ("image", h, w) an image span, ("video", t, h, w) a video with t
    temporal slices (one <|begin_of_image|> ... <|end_of_image|> span each, inside <|begin_of_video|> ...).
    Rows are left-padded with pad id 0 to one length. -> input_ids, attention_mask, pixel_values,
    image_grid_thw, pixel_values_videos, video_grid_thw (None where absent)."""
    T = TOKENS
    ids, images, videos = [], [], []
    for row in rows:
        out = []
        for item in row:
            if isinstance(item, int):
                out.append(item)
            elif item[0] == "image":
                _, h, w = item
                images.append((1, h, w))
                placeholders = [T["image_token_id"]] * (h * w // merge**2)
                out += [T["image_start_token_id"], *placeholders, T["image_end_token_id"]]
            else:
                _, t, h, w = item
                videos.append((t, h, w))
                out.append(T["video_start_token_id"])
                for _ in range(t):
                    out += [
                        T["image_start_token_id"],
                        *[T["image_token_id"]] * (h * w // merge**2),
                        T["image_end_token_id"],
                        7,
                    ]
                out.append(T["video_end_token_id"])
        ids.append(out)
    width = max(len(r) for r in ids)
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in ids])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    batch = dict(input_ids=input_ids, attention_mask=attention_mask)
    batch["pixel_values"], batch["image_grid_thw"] = pixels(images, seed=seed) if images else (None, None)
    batch["pixel_values_videos"], batch["video_grid_thw"] = pixels(videos, seed=seed + 1) if videos else (None, None)
    return batch
