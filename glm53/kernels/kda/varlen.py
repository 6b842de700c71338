"""Packed documents in the KDA kernels (`cu_seqlens` over the flattened B * T tokens, kernels/varlen.py).

Legend: B batch, T time, C chunk length, N = T / C chunks.
Every document restarts from a zero state, as if it ran alone (no initial or final state then). The references
loop over the documents (`per_document`); the fast chunk form chunks every row as it would without boundaries
(so a row's numbers do not depend on the other rows) and masks, per chunk, what would cross a document start
(`DocMasks`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...utils import ceil_div
from ..varlen import check_cu_seqlens, document_slices, position_in_document, token_documents


def no_states(initial_state, output_final_state) -> None:
    if initial_state is not None or output_final_state:
        raise ValueError(
            "kda: initial_state / output_final_state are not supported with cu_seqlens "
            "(every packed document starts from a zero state)"
        )


def per_document(kda, xs, scale, initial_state, output_final_state, cu_seqlens):
    """Run `kda` on each document of xs = (q, k, v, g, beta) alone and put the outputs back in place."""
    no_states(initial_state, output_final_state)
    B, T = xs[0].shape[:2]
    cu = check_cu_seqlens(cu_seqlens, B, T)
    o = xs[2].new_zeros(xs[2].shape, dtype=xs[0].dtype)
    for b, s, e in document_slices(cu, T):
        o[b : b + 1, s:e] = kda(*(x[b : b + 1, s:e] for x in xs), scale=scale)[0]
    return o, None


class DocMasks(NamedTuple):
    """Packed documents inside the chunked form ([B, 1, N, C, *], broadcast over heads), as 0/1 factors.

    With the plain cumulative decay G of the chunk, exp(G_t - G_j) is still the right decay between two tokens
    of one document (it sums only their document's steps), so a document start needs no change to G: the
    products between documents are zeroed (`same`), a token reads the chunk's start state only if no document
    starts between the chunk start and it (`carry`), and only the chunk's last document writes into the next
    state (`last`, and `carry_end` for the decayed start state).
    """

    same: torch.Tensor  # [C, C] token t and j in one document
    carry: torch.Tensor  # [C, 1] no document start in [chunk start, t]
    last: torch.Tensor  # [C, 1] token j in the chunk's last document
    carry_end: torch.Tensor  # [1, 1] carry of the chunk's last token


def doc_masks(cu_seqlens: torch.Tensor, B: int, T: int, C: int, dtype: torch.dtype) -> DocMasks:
    """`DocMasks` for B rows of T tokens in chunks of C (a row's padding joins its last document)."""
    N = ceil_div(T, C)
    pad = N * C - T
    doc = token_documents(cu_seqlens, B * T).view(B, T)
    doc = torch.cat([doc, doc[:, -1:].expand(B, pad)], dim=1).view(B, N, C)
    starts = torch.nn.functional.pad((position_in_document(cu_seqlens, B * T) == 0).view(B, T), (0, pad))
    starts = starts.view(B, N, C)
    same = doc[..., :, None] == doc[..., None, :]  # [B, N, C, C]
    carry = (doc == doc[..., :1]) & ~starts[..., :1] & (starts.long().cumsum(-1) == 0)  # [B, N, C]
    last = doc == doc[..., -1:]
    as_factor = lambda m: m.to(dtype)[:, None]  # noqa: E731  [B, 1, N, ...]: broadcast over heads
    return DocMasks(
        as_factor(same), as_factor(carry[..., None]), as_factor(last[..., None]), as_factor(carry[..., -1:, None])
    )


__all__ = ["DocMasks", "doc_masks", "no_states", "per_document"]
