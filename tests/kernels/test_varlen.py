"""Packed-document boundaries in the kernels (glm53/kernels/varlen.py): the per-token forms against plain loops, on
boundaries with empty documents and several rows; its checks' named errors, and every packed kernel refusing bad
boundaries.

Legend (glm53/model/__init__.py): B batch, T time (S: the keys' sequence), P pools, n documents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels.conv import causal_conv1d
from glm53.kernels.indexer_scores import indexer_scores
from glm53.kernels.sparse_attention import (
    sparse_attention,
)
from glm53.kernels.varlen import (
    check_cu_seqlens,
    document_bounds,
    document_slices,
    own_document_pools,
    position_in_document,
    token_documents,
)

B, T = 2, 6
CU = [0, 2, 2, 5, 6, 6, 9, 12]  # empty documents inside a row and at a row start


def owner(t: int) -> int:
    """The document holding flattened token t (the non-empty one)."""
    return next(i for i in range(len(CU) - 1) if CU[i] <= t < CU[i + 1])


def test_per_token_forms_equal_loops():
    cu = check_cu_seqlens(torch.tensor(CU), B, T)  # duplicates (empty documents) are allowed
    docs = [owner(t) for t in range(B * T)]
    assert token_documents(cu, B * T).tolist() == docs
    assert position_in_document(cu, B * T).tolist() == [t - CU[d] for t, d in enumerate(docs)]
    start, end = document_bounds(cu, B, T)
    assert start.flatten().tolist() == [CU[d] - (t // T) * T for t, d in enumerate(docs)]
    assert end.flatten().tolist() == [CU[d + 1] - (t // T) * T for t, d in enumerate(docs)]
    assert document_slices(cu, T) == [(0, 0, 2), (0, 2, 5), (0, 5, 6), (1, 0, 3), (1, 3, 6)]


@pytest.mark.parametrize("offset,n", [(0, T), (2, 3)])
def test_own_document_pools_equal_loop(offset, n):
    pool_start = torch.tensor([[0, 1, 2, 4, 5, 6], [0, 2, 3, 5, 6, 6]])  # 6: a slot past the row
    mask = own_document_pools(pool_start, torch.tensor(CU), T, offset, n)
    want = [
        [
            [
                CU[owner(b * T + offset + t)] <= b * T + s < CU[owner(b * T + offset + t) + 1] if s < T else False
                for s in pool_start[b].tolist()
            ]
            for t in range(n)
        ]
        for b in range(B)
    ]
    assert mask.tolist() == want


BAD = [
    ([1, 6, 12], "start at 0"),
    ([0, 6, 11], "end at 12"),
    ([0, 7, 5, 12], "non-decreasing"),
    ([0, 4, 12], "every row start"),
]


@pytest.mark.parametrize("cu,message", BAD)
def test_bad_boundaries_name_the_problem(cu, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(cu), B, T)


# ---------------------------------------------------------------------------------------- kernels refuse bad boundaries
def test_kernels_reject_bad_boundaries():
    x, w = torch.randn(2, 5, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="row start"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 10]))  # a document over the row boundary at 5
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 5, 4, 10]))
    with pytest.raises(ValueError, match="1-D integer"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0.0, 5.0, 10.0]))
    q = F.normalize(torch.randn(1, 5, 2, 4), dim=-1)
    with pytest.raises(ValueError, match="S == T"):
        sparse_attention(
            q,
            torch.randn(1, 6, 2, 4),
            torch.randn(1, 6, 2, 4),
            torch.zeros(1, 5, 2, dtype=torch.long),
            1.0,
            cu_seqlens=torch.tensor([0, 5]),
        )
    with pytest.raises(ValueError, match="pool_start"):
        indexer_scores(
            torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2), torch.randn(1, 2, 4), 1.0, cu_seqlens=torch.tensor([0, 5])
        )
