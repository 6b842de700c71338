"""`context_parallel_inputs`: this rank's keyword arguments for `model(**kwargs)` under context parallelism.

Legend (glm53/model/__init__.py): B batch, T time (the whole sequence), cp the context-parallel ranks.
Rank r of the "cp" mesh dimension holds positions [r T', (r + 1) T') of every row, T' = ceil(T / cp): a T that
cp does not divide is right-padded with masked tokens (attention_mask 0, label -100), which changes nothing a
valid position computes (padding never enters KDA's state or the indexer's pools, nor any loss or expert load).
Labels become next-token targets before slicing (the target of a rank's last position is the next rank's first
label), packed documents become per-document `position_ids` (restarting at 0; a rank tells a document that
continues from the previous rank by its first position), and the loss denominators are counted on the whole
sequences, so that every loss part on every cp rank is the one-process loss of the batch.
The VL model (Glm53ForConditionalGeneration): each cp rank gets the pixels of the images and videos whose
placeholders its slice holds (an image whose placeholder run crosses a slice boundary goes to both ranks, each
splicing its own rows of the features) and `placeholders`: this slice's placeholders, found in the whole rows (a
video's begin marker may lie on an earlier rank), and the feature row each takes (vision/splice.py). The tower's
parameter gradients are then each rank's share, reduced over cp like every other parameter's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..kernels.varlen import position_in_document
from ..losses import Glm53ForCausalLM
from ..losses.counts import LossCounts
from ..losses.parts import IGNORE_INDEX, next_token_targets
from ..model.packing import document_boundaries
from ..utils import ceil_div
from ..vision.splice import media_for_slice, sliced_placeholders
from ..vision.tower import check_vision_inputs
from .cp_shards import CpShards
from .mesh import DATA_DIMS
from .parallelize import context_parallel_mesh
from .runtime import loss_denominators as dp_denominators


def _pad(x: torch.Tensor | None, width: int, value: int) -> torch.Tensor | None:
    return None if x is None or width == 0 else F.pad(x, (0, width), value=value)


def _document_positions(B: int, T: int, width: int, device, cu_seqlens, position_ids) -> torch.Tensor | None:
    """[B, T + width] position of every token in its document (padding continues the row's last document),
    or None when every row is one document."""
    cu = document_boundaries(B, T, device, cu_seqlens, position_ids)
    if cu is None:
        return None
    pos = position_in_document(cu, B * T).view(B, T)
    return torch.cat([pos, pos[:, -1:] + torch.arange(1, width + 1, device=device)], dim=1)


def context_parallel_inputs(
    model: Glm53ForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    mesh: DeviceMesh | None = None,
    loss_denominators: LossCounts | None = None,
    **vision: torch.Tensor | None,
) -> dict:
    """This rank's slice of a batch of whole sequences [B, T] -> kwargs for `model(**kwargs)`.

    `mesh`: the "cp" mesh dimension (default: the one `parallelize(model, mesh, cp_dim=...)` recorded).
    `loss_denominators`: the counts of the global batch (gradient accumulation: every micro-batch's, summed);
    by default this batch's, summed over the ranks that read their own rows (dp and ep, mesh.DATA_DIMS) and
    divided by their number (`glm53.parallel.loss_denominators`), so every such rank passes its own whole
    sequences.
    `vision` (the VL model): pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw of the whole batch.
    """
    cp_mesh, full_mesh = context_parallel_mesh(model, mesh)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    for name, x in (("labels", labels), ("attention_mask", attention_mask), ("position_ids", position_ids)):
        if x is not None and tuple(x.shape) != (B, T):
            raise ValueError(f"{name} must have the shape of input_ids {(B, T)}, got {tuple(x.shape)}")
    size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    local = ceil_div(T, size)
    width = local * size - T
    if width >= local:
        raise ValueError(f"seq {T} is too short for {size} context-parallel ranks (every rank needs a token)")
    mask = attention_mask
    if mask is None and width:
        mask = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    positions = _document_positions(B, T, width, input_ids.device, cu_seqlens, position_ids)
    mine = slice(rank * local, (rank + 1) * local)
    kwargs = dict(
        input_ids=(_pad(input_ids, width, pad_id) if width else input_ids)[:, mine], cp=CpShards(cp_mesh, local)
    )
    kwargs.update(_vision_inputs(model, input_ids, mine, vision))
    if mask is not None:
        kwargs["attention_mask"] = (_pad(mask, width, 0) if width else mask)[:, mine]
    if positions is not None:
        kwargs["position_ids"] = positions[:, mine]
    if labels is not None:
        targets = next_token_targets(labels)
        kwargs["labels"] = (_pad(targets, width, IGNORE_INDEX) if width else targets)[:, mine]
        if loss_denominators is None:
            counts = model.loss_counts(labels, attention_mask, None if positions is None else positions[:, :T])
            loss_denominators = dp_denominators(counts, full_mesh, DATA_DIMS)  # dp x ep read their own rows
        kwargs["loss_denominators"] = loss_denominators
    return kwargs


def _vision_inputs(model: Glm53ForCausalLM, input_ids: torch.Tensor, mine: slice, vision: dict) -> dict:
    """The VL model's vision keywords for this slice: the pixels and grids of the images / videos its placeholders
    take, and `placeholders` (vision/splice.py); {} for a text model. Inputs the model would reject (pixels
    without a grid, ...) pass through unchanged, so every rank raises the one-process error."""
    unknown = sorted(set(vision) - set(VISION_INPUTS))
    if unknown:
        raise TypeError(f"context_parallel_inputs got unexpected keyword arguments {unknown}")
    tokens = getattr(model, "token_ids", None)
    if tokens is None:
        given = sorted(name for name, x in vision.items() if x is not None)
        if given:
            raise ValueError(
                f"{given} given for a text-only model ({type(model).__name__}): images need the VL model "
                f"(Glm53ForConditionalGeneration)"
            )
        return {}
    out, placeholders = {}, []
    for at, kind, (pix_name, grid_name) in zip(sliced_placeholders(input_ids, tokens, mine), ("image", "video"), PAIRS):
        pixels, grid = vision.get(pix_name), vision.get(grid_name)
        if pixels is not None and grid is not None:
            grid = check_vision_inputs(pixels, grid, model.vision_config, pix_name, grid_name)
            pixels, grid, at = media_for_slice(at, pixels, grid, model.vision_config.spatial_merge_size, kind)
        out.update({name: x for name, x in ((pix_name, pixels), (grid_name, grid)) if x is not None})
        placeholders.append(at)
    return dict(out, placeholders=tuple(placeholders))


PAIRS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
VISION_INPUTS = tuple(name for pair in PAIRS for name in pair)

__all__ = ["context_parallel_inputs"]
