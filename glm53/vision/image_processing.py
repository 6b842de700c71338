"""The image processor: RGB pixels -> the tower's `pixel_values` [N, C·T·P·P] and `image_grid_thw` [I, 3].

Legend: I images, F frames, C = 3 channels, H/W pixel height/width, P patch size (14), m merge size (2),
T temporal patch size (2), N patch rows (Σ t·h·w over items), h/w the grid in patches.
The rules of transformers 5.23's `Glm5NextImageProcessorPil` (`image_processing_pil_glm5_next.py`), in torch:
1. canvas (`canvas_size`, transformers' `smart_resize`): each side rounded up to a multiple of F = P·m = 28;
   budgets count T frames per image, T·F² = 1568 pixels per token. Below `min_tokens` the image is scaled up to
   it; above `max_tokens` a binary search finds the largest content height whose canvas fits.
2. content (`content_size`): the image is resized (bicubic) only when the canvas needs it (below the minimum,
   above the maximum); otherwise it keeps its pixels and is padded bottom/right with black to the canvas.
3. rescale by 1/255 (in float64, then float32, as transformers) and normalise with the CLIP mean and std.
4. patchify (`patchify`) to rows in the tower's order: temporal slice, m×m merge block (row-major), the block's
   patches (row-major); each row holds (C, T, P, P). An image is its frame repeated T times; grid (1, h, w).
Resizing (`resize_bicubic`) is Pillow's separable bicubic (a = -0.5, antialiased when shrinking), width pass then
height pass, each rounded and clamped to uint8 as Pillow's 8-bit path does; it differs from Pillow only where
Pillow's fixed-point weights round a value sitting on .5 the other way (tests/vision derive the bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from ..errors import InputError
from .media import as_rgb

PATCH_SIZE = 14  # P: pixels per patch side (vision_config.patch_size)
MERGE_SIZE = 2  # m: patches per merge-block side (vision_config.spatial_merge_size)
TEMPORAL_PATCH_SIZE = 2  # T: frames per patch row (vision_config.temporal_patch_size)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP, per RGB channel (transformers' OPENAI_CLIP_MEAN)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # (OPENAI_CLIP_STD)
RESCALE = 1 / 255
MIN_IMAGE_TOKENS = 16  # transformers' Glm5NextImageProcessorPil.min_image_tokens
MAX_IMAGE_TOKENS = 8000  # .max_image_tokens


class BudgetError(InputError):
    """Media that cannot be fitted into the token budget; the message names the sizes and the budget."""


def _align(value: int, factor: int) -> int:
    return math.ceil(value / factor) * factor


def canvas_size(
    frames: int,
    height: int,
    width: int,
    min_tokens: int,
    max_tokens: int,
    factor: int = 28,
    temporal: int = TEMPORAL_PATCH_SIZE,
) -> tuple[int, int]:
    """The padded canvas (height, width), multiples of `factor`, for `frames` frames of height x width within
    [min_tokens, max_tokens] tokens of temporal·factor² pixels (transformers' `smart_resize`). A content whose
    aspect ratio cannot fit the maximum at any height is a BudgetError (transformers silently squashes it into
    one factor x factor block)."""
    per_token = temporal * factor**2
    low_px, high_px = min_tokens * per_token, max_tokens * per_token
    aligned_frames = max(temporal, round(frames / temporal) * temporal)
    if high_px < aligned_frames * factor**2:
        raise BudgetError(
            f"max tokens {max_tokens} cannot hold even one {factor}x{factor} block per slice of {aligned_frames} frames"
        )
    canvas_h, canvas_w = _align(height, factor), _align(width, factor)
    if aligned_frames * canvas_h * canvas_w < low_px:
        scale = math.sqrt(low_px / (frames * height * width))
        canvas_h = _align(max(1, math.ceil(height * scale)), factor)
        canvas_w = _align(max(1, math.ceil(width * scale)), factor)
    if aligned_frames * canvas_h * canvas_w > high_px:
        fit = _fit_within(aligned_frames, height, width, high_px, factor)
        if fit is None:
            raise BudgetError(
                f"a {height}x{width} (height x width) picture cannot fit {max_tokens} tokens at any "
                f"scale (its aspect ratio is too extreme for that budget)"
            )
        canvas_h, canvas_w = fit
    return canvas_h, canvas_w


def _fit_within(aligned_frames: int, height: int, width: int, high_px: int, factor: int) -> tuple[int, int] | None:
    """Binary search on the content height for the largest canvas within `high_px` pixels (None: none fits)."""
    low, high, best = 1, height, None
    while low <= high:
        content_h = (low + high) // 2
        content_w = max(1, math.floor(width * content_h / height))
        candidate = _align(content_h, factor), _align(content_w, factor)
        if aligned_frames * candidate[0] * candidate[1] <= high_px:
            best, low = candidate, content_h + 1
        else:
            high = content_h - 1
    return best


def content_size(
    frames: int,
    height: int,
    width: int,
    canvas: tuple[int, int],
    min_tokens: int,
    factor: int = 28,
    temporal: int = TEMPORAL_PATCH_SIZE,
) -> tuple[int, int]:
    """The size the pixels are resized to inside `canvas` (their own size unless the budget forces a scale)."""
    scale = min(canvas[0] / height, canvas[1] / width)
    if frames * height * width >= temporal * factor**2 * min_tokens:  # not below the minimum: never enlarge
        scale = min(1.0, scale)
    return (max(1, min(canvas[0], math.floor(height * scale))), max(1, min(canvas[1], math.floor(width * scale))))


def resize_bicubic(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [..., C, H, W] -> uint8 [..., C, size[0], size[1]]: Pillow's 8-bit bicubic resize (width pass, then
    height pass, each rounded and clamped to 0..255)."""
    lead, (channels, height, width) = pixels.shape[:-3], pixels.shape[-3:]
    x = pixels.reshape(-1, channels, height, width).to(torch.float32)
    for target in ((height, size[1]), tuple(size)):  # torch's antialiased bicubic is Pillow's filter (a = -0.5)
        if tuple(x.shape[-2:]) != target:
            x = F.interpolate(x, size=target, mode="bicubic", antialias=True, align_corners=False)
            x = x.round().clamp(0, 255)
    return x.to(torch.uint8).reshape(*lead, channels, *size)


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C, H, W] -> float32, rescaled by 1/255 in float64 (transformers' `rescale`) then
    (x - mean) / std per channel in float32."""
    x = (pixels.to(torch.float64) * RESCALE).to(torch.float32)
    mean = torch.tensor(CLIP_MEAN, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(CLIP_STD, dtype=torch.float32).view(-1, 1, 1)
    return (x - mean) / std


def patchify(
    frames: torch.Tensor, patch: int = PATCH_SIZE, merge: int = MERGE_SIZE, temporal: int = TEMPORAL_PATCH_SIZE
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """frames [F, C, H, W] (F a multiple of T; H, W multiples of P·m) -> (rows [t·h·w, C·T·P·P], (t, h, w))."""
    n, _, height, width = frames.shape
    t, h, w = n // temporal, height // patch, width // patch
    rows = rearrange(
        frames,
        "(t T) C (hb m1 P1) (wb m2 P2) -> (t hb wb m1 m2) (C T P1 P2)",
        T=temporal,
        m1=merge,
        m2=merge,
        P1=patch,
        P2=patch,
    )
    return rows, (t, h, w)


@dataclass
class ImageProcessor:
    """`ImageProcessor()(images)` -> {"pixel_values": float32 [N, 1176], "image_grid_thw": int64 [I, 3]}.

    images: a list of PIL images, uint8 [H, W, 3] tensors or file paths (decoded through Pillow, extra `vl`).
    """

    min_tokens: int = MIN_IMAGE_TOKENS  # per image, after the m×m merge (transformers' min_image_tokens)
    max_tokens: int = MAX_IMAGE_TOKENS  # (max_image_tokens)
    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens", "patch_size", "merge_size", "temporal_patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"ImageProcessor.{name} must be a positive int, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise InputError(f"ImageProcessor.min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def canvas(self, height: int, width: int) -> tuple[int, int]:
        """The padded canvas of a height x width image."""
        return canvas_size(
            self.temporal_patch_size,
            height,
            width,
            self.min_tokens,
            self.max_tokens,
            self.factor,
            self.temporal_patch_size,
        )

    def num_tokens(self, height: int, width: int) -> int:
        """Language-model tokens (`<|image|>` placeholders) of a height x width image: h·w/m²."""
        canvas_h, canvas_w = self.canvas(height, width)
        return (canvas_h // self.factor) * (canvas_w // self.factor)

    def process(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image, uint8 [H, W, 3] -> (rows [h·w, C·T·P·P], grid (1, h, w))."""
        chw = pixels.permute(2, 0, 1)
        height, width = chw.shape[-2:]
        canvas = self.canvas(height, width)
        size = content_size(
            self.temporal_patch_size, height, width, canvas, self.min_tokens, self.factor, self.temporal_patch_size
        )
        if size != (height, width):
            chw = resize_bicubic(chw, size)
        chw = F.pad(chw, (0, canvas[1] - size[1], 0, canvas[0] - size[0]))  # black, bottom/right, before normalising
        frame = normalize(chw)
        frames = frame.unsqueeze(0).expand(self.temporal_patch_size, *frame.shape)
        return patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size)

    def __call__(self, images) -> dict[str, torch.Tensor]:
        if not isinstance(images, (list, tuple)) or not images:
            raise InputError(f"ImageProcessor: expected a non-empty list of images, got {type(images).__name__}")
        rows, grids = [], []
        for i, image in enumerate(images):
            r, grid = self.process(as_rgb(image, f"images[{i}]"))
            rows.append(r)
            grids.append(grid)
        return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "MAX_IMAGE_TOKENS",
    "MIN_IMAGE_TOKENS",
    "BudgetError",
    "ImageProcessor",
    "canvas_size",
    "content_size",
    "normalize",
    "patchify",
    "resize_bicubic",
]
