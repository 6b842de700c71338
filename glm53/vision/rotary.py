"""Patch positions and the 2-D axial rotary embedding of the vision tower (transformers' vision_utils and
Glm5NextVisionRotaryEmbedding).

Legend: N patch rows, n items (images or videos), m merge size, hd head width.
Rows of one item (t, h, w) are ordered temporal slice major, then m x m merge blocks in row-major block order,
then the m * m patches of a block row-major; `patch_positions` gives each row's (row, col) patch index [N, 2],
repeated per temporal slice. The inverse frequencies theta^(-k / (hd/4)), k < hd/4, are computed in fp32 on every
call (no buffer): casting the model to bf16 cannot round them, and a checkpoint has nothing to store.
Angles of rows and columns are concatenated (row, col, row, col) over the whole head width; the rotation pairs
dims (i, i + hd/2) (rotate-half) and runs in fp32.
"""

from __future__ import annotations

import torch


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """int64 [N, 2] (row, col) of every patch row, loop-free over the items."""
    t, h, w = grid_thw.long().unbind(-1)  # [n] each
    per_slice = h * w
    items = torch.repeat_interleave(torch.arange(grid_thw.shape[0], device=grid_thw.device), t * per_slice)
    first = torch.cumsum(t * per_slice, 0) - t * per_slice  # [n] first row of each item
    j = (torch.arange(items.shape[0], device=grid_thw.device) - first[items]) % per_slice[items]  # index in slice
    block, inside = j // (merge * merge), j % (merge * merge)
    blocks_per_row = w[items] // merge
    row = (block // blocks_per_row) * merge + inside // merge
    col = (block % blocks_per_row) * merge + inside % merge
    return torch.stack([row, col], dim=-1)


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """fp32 [hd/4]: theta^(-2k / (hd/2)) for k < hd/4, as transformers' compute_axial_rope_parameters."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))


def axial_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 2] -> fp32 cos, sin [N, hd] laid out (row, col, row, col)."""
    freqs = positions[..., None].float() * inverse_frequencies(head_dim, theta, positions.device)  # [N, 2, hd/4]
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, hd]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd] rotated in fp32 by cos, sin [N, hd]; cast back to x's dtype."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


__all__ = ["apply_rotary", "axial_cos_sin", "inverse_frequencies", "patch_positions", "rotate_half"]
