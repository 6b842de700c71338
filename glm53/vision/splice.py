"""The splice: merged vision features replace the placeholder embeddings, as transformers'
Glm5NextModel.get_placeholder_mask + masked_scatter do.

Legend: B batch, T time, D model width, F feature rows (merged patches) of all images (or all videos).
`<|image|>` is the placeholder of images AND video frames: a placeholder is a video one when, along its row, the
count of `<|begin_of_video|>` so far exceeds the count of `<|end_of_video|>` (an unterminated span turns every
later placeholder of the row into a video one). Image features (all images of the batch, concatenated in order)
fill the image placeholders in row-major order over the flattened [B, T] ids; video features the video ones.

Context parallelism (a forward over one slice [B, T'] of every row): `sliced_placeholders` finds the
placeholders in the whole rows (a video's begin marker may lie on an earlier rank) and gives the slice's mask, the
feature row each of its placeholders takes in the whole batch's order (an image whose run crosses a slice
boundary is split exactly there) and the whole batch's count, which the check compares with the features.
`media_for_slice` then keeps only the images (or videos) whose placeholders the slice holds, with the rows
renumbered into their features: the tower's output for an item depends on that item alone (attention never
crosses items), so each rank runs the tower on its own items and gets exactly their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .config import MultimodalTokenIds


@dataclass(frozen=True)
class Placeholders:
    """One kind's placeholders in a forward's ids: `mask` [B, T'] bool; `rows` [mask.sum()] long, the feature row
    each takes, in the mask's row-major order (None: 0, 1, 2, ..., the whole batch in one process); `count` the
    whole batch's placeholders, which the features must number (None: the mask's)."""

    mask: torch.Tensor
    rows: torch.Tensor | None = None
    count: int | None = None


def placeholder_masks(input_ids: torch.Tensor, tokens: MultimodalTokenIds) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (image mask, video mask), bool [B, T] each."""
    placeholder = input_ids == tokens.image_token_id
    opened = (input_ids == tokens.video_start_token_id).cumsum(-1)
    closed = (input_ids == tokens.video_end_token_id).cumsum(-1)
    in_video = opened > closed
    return placeholder & ~in_video, placeholder & in_video


def sliced_placeholders(
    input_ids: torch.Tensor, tokens: MultimodalTokenIds, columns: slice
) -> tuple[Placeholders, Placeholders]:
    """(image, video) Placeholders of the columns `columns` of the whole rows `input_ids` [B, T]; columns past T
    (a context-parallel slice of right padding) hold none."""
    out = []
    for mask in placeholder_masks(input_ids, tokens):
        rows = mask.flatten().cumsum(0).view(mask.shape) - 1  # the feature row of every placeholder
        width = max(0, columns.stop - mask.shape[1])
        local = torch.nn.functional.pad(mask, (0, width), value=False)[:, columns]
        rows = torch.nn.functional.pad(rows, (0, width), value=0)[:, columns]
        out.append(Placeholders(local, rows[local], int(mask.sum())))  # NOTE: syncs
    return out[0], out[1]


def check_count(count: int, given: int, kind: str) -> None:
    """The placeholders must number the feature rows the grids give: an InputError naming both otherwise."""
    if count != given:
        source = "pixel_values" if kind == "image" else "pixel_values_videos"
        raise InputError(
            f"input_ids hold {count} {kind} placeholder tokens but {source} give {given} {kind} "
            f"feature rows (t*h*w / merge^2 summed over the {kind} grids): they must be "
            f"equal"
        )


def media_for_slice(
    where: Placeholders, pixels: torch.Tensor, grid: torch.Tensor, merge: int, kind: str
) -> tuple[torch.Tensor | None, torch.Tensor | None, Placeholders]:
    """(pixels [N', C*T*P*P], grid [items', 3], Placeholders) of the items (images or videos, validated `grid`
    [items, 3] over `pixels` [N, ...]) whose feature rows the slice's placeholders `where` take, the rows
    renumbered into those items' features; (None, None, ...) when the slice holds none of them."""
    patches = grid.prod(-1)  # [items] patch rows of each item
    sizes = patches // (merge * merge)  # its feature rows
    check_count(where.count, int(sizes.sum()), kind)  # NOTE: syncs; the whole batch's check, on every rank
    ends = sizes.cumsum(0)
    item = torch.searchsorted(ends, where.rows, right=True)  # the item of each of the slice's rows
    mine = torch.unique(item)  # sorted
    keep = torch.zeros_like(sizes, dtype=torch.bool)
    keep[mine] = True
    local_ends = (sizes * keep).cumsum(0)  # the kept items' features, concatenated in order
    rows = where.rows - (ends - sizes)[item] + (local_ends - sizes)[item]
    picked = Placeholders(where.mask, rows, int(sizes[mine].sum()))
    if mine.numel() == 0:
        return None, None, picked
    patch_item = torch.repeat_interleave(torch.arange(len(patches), device=patches.device), patches)
    return pixels[keep[patch_item].to(pixels.device)], grid[mine], picked


def splice(
    embeds: torch.Tensor, where: torch.Tensor | Placeholders, features: torch.Tensor | None, kind: str
) -> torch.Tensor:
    """embeds [B, T, D] with rows of `features` [F, D] written at the placeholders `where` (a mask [B, T]: every
    row in order, F must equal its count; or Placeholders: the rows it names, F its whole-batch count). `kind`
    ("image" / "video") names the inputs in the error."""
    where = where if isinstance(where, Placeholders) else Placeholders(where)
    count = int(where.mask.sum()) if where.count is None else where.count  # NOTE: syncs
    check_count(count, 0 if features is None else features.shape[0], kind)
    if features is None:
        return embeds
    picked = features if where.rows is None else features[where.rows]
    return embeds.masked_scatter(where.mask[..., None], picked.to(embeds.dtype))


__all__ = ["Placeholders", "check_count", "media_for_slice", "placeholder_masks", "sliced_placeholders", "splice"]
