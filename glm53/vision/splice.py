"""The splice: merged vision features replace the placeholder embeddings, as transformers'
Glm5NextModel.get_placeholder_mask + masked_scatter do.

Legend: B batch, T time, D model width, F feature rows (merged patches) of all images (or all videos).
`<|image|>` is the placeholder of images AND video frames: a placeholder is a video one when, along its row, the
count of `<|begin_of_video|>` so far exceeds the count of `<|end_of_video|>` (an unterminated span turns every
later placeholder of the row into a video one). Image features (all images of the batch, concatenated in order)
fill the image placeholders in row-major order over the flattened [B, T] ids; video features the video ones.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .config import MultimodalTokenIds


def placeholder_masks(input_ids: torch.Tensor, tokens: MultimodalTokenIds) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (image mask, video mask), bool [B, T] each."""
    placeholder = input_ids == tokens.image_token_id
    opened = (input_ids == tokens.video_start_token_id).cumsum(-1)
    closed = (input_ids == tokens.video_end_token_id).cumsum(-1)
    in_video = opened > closed
    return placeholder & ~in_video, placeholder & in_video


def splice(embeds: torch.Tensor, mask: torch.Tensor, features: torch.Tensor | None, kind: str) -> torch.Tensor:
    """embeds [B, T, D] with the rows of `features` [F, D] written where `mask` [B, T] is set (F must equal the
    mask's count). `kind` ("image" / "video") names the inputs in the error."""
    count = int(mask.sum())  # NOTE: syncs
    given = 0 if features is None else features.shape[0]
    if count != given:
        source = "pixel_values" if kind == "image" else "pixel_values_videos"
        raise InputError(
            f"input_ids hold {count} {kind} placeholder tokens but {source} give {given} {kind} "
            f"feature rows (t*h*w / merge^2 summed over the {kind} grids): they must be "
            f"equal"
        )
    if features is None:
        return embeds
    return embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))


__all__ = ["placeholder_masks", "splice"]
