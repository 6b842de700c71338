"""Attention of the vision tower: full and bidirectional inside each segment (an image, or one temporal slice of a
video), none across segments.

Legend: N patch rows of all segments, H heads, hd head width, S segments, L a segment's length (Lmax the longest
of a group). q, k, v: [N, H, hd]; cu_seqlens: int [S + 1], cumulative segment lengths over the N rows.
    out[i] = softmax(q_i k_j^T * scale over j in segment(i)) v_j      (softmax in fp32, cast back)
`segment_attention_reference` loops over the segments (transformers' eager path does the same); the fast form
gathers segments of similar length into one padded batch each and runs one `scaled_dot_product_attention` per
group (a key-padding mask where lengths differ), so a batch of mixed-size images costs a handful of calls, not
one per image, and padding wastes at most 1 / GROUP_RATIO^2 of a group's attention work per segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register

# A segment joins a group while its length is at least this fraction of the group's longest.
GROUP_RATIO = 0.75


def segment_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Loop over segments; fp32 scores and softmax (fp64 inputs stay fp64), cast back to q's dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = []
    bounds = cu_seqlens.tolist()  # NOTE: syncs
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1).to(acc) for t in (q, k, v))  # [H, L, hd]
        p = torch.softmax(torch.einsum("hid,hjd->hij", qs, ks) * scale, dim=-1)
        outs.append(torch.einsum("hij,hjd->hid", p, vs).transpose(0, 1).to(q.dtype))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Segment indices grouped by similar length (longest first); empty segments are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= GROUP_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _run(starts: list[int], lengths: list[int], group: list[int]) -> tuple[int, int] | None:
    """(first row, rows) when the group's segments are equally long and back to back (one image, or a video's
    temporal slices): its q, k, v are then a view [G, L, H, hd] of the rows, with no gather and no mask."""
    ordered = sorted(group)
    L = lengths[ordered[0]]
    if all(lengths[i] == L and starts[i] == starts[ordered[0]] + j * L for j, i in enumerate(ordered)):
        return starts[ordered[0]], L
    return None


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same result as the reference: one padded SDPA call per group of similar-length segments. Groups of
    back-to-back equal segments (every image alone in its group, a video's slices) read views of q, k, v; when
    every group is such a run the output is their concatenation in row order (no gather, no scatter: a batch of
    mixed-size images costs what transformers' per-image loop does around the attention itself)."""
    N = q.shape[0]
    bounds = cu_seqlens.tolist()  # NOTE: syncs (the group shapes are host sizes)
    if not bounds or bounds[0] != 0 or bounds[-1] != N:
        raise ValueError(f"cu_seqlens must run from 0 to the {N} rows of q, got {bounds[:1]} .. {bounds[-1:]}")
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    groups = length_groups(lengths)
    runs = [_run(starts, lengths, g) for g in groups]
    if groups and all(r is not None for r in runs):
        ordered = sorted(zip(runs, groups))  # row order; the runs tile the rows (empty segments hold none)
        sizes = [len(group) * L for (_, L), group in ordered]
        # one split per tensor, not a slice per run: a slice's backward zero-fills all N rows and adds its part
        # (G fills and adds of [N, H, hd] per tensor); the split's backward is one concatenation
        parts = [torch.split(t, sizes) for t in (q, k, v)]
        outs = []
        for j, ((_, L), group) in enumerate(ordered):
            qg, kg, vg = (p[j].view(len(group), L, *q.shape[1:]).transpose(1, 2) for p in parts)  # [G, H, L, hd]
            o = F.scaled_dot_product_attention(qg, kg, vg, scale=scale)  # [G, H, L, hd]
            outs.append(o.transpose(1, 2).reshape(sizes[j], *q.shape[1:]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    rows, values = [], []
    for group in groups:
        L = lengths[group[0]]
        start = torch.tensor([starts[i] for i in group], device=q.device)  # [G]
        length = torch.tensor([lengths[i] for i in group], device=q.device)  # [G]
        offset = torch.arange(L, device=q.device)
        valid = offset[None, :] < length[:, None]  # [G, L]
        index = (start[:, None] + offset[None, :]).clamp(max=N - 1)  # [G, L]; padded slots read any real row
        qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))  # [G, H, L, hd]
        mask = None if all(lengths[i] == L for i in group) else valid[:, None, None, :]  # [G, 1, 1, L] keys
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)  # [G, H, L, hd]
        o = o.transpose(1, 2)[valid]  # [rows of the group, H, hd]
        rows.append(index[valid])
        values.append(o)
    if not rows:
        return q.new_zeros(q.shape)
    return q.new_zeros(q.shape).index_copy(0, torch.cat(rows), torch.cat(values))


register("segment_attention", "reference", segment_attention_reference)
register("segment_attention", "fast", segment_attention)

__all__ = ["GROUP_RATIO", "length_groups", "segment_attention", "segment_attention_reference"]
