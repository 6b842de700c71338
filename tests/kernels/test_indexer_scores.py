"""The indexer's scores (glm53/kernels/indexer_scores.py): the query-chunked fast kernel equals the reference,
forward and every gradient, for any chunking (one pool, one query, chunks that split the pools); both backends
select the same pools; with packed documents (`cu_seqlens`) the scores equal each document's alone (one chunk
and many). Tolerance FP32_TOL (tests/helpers/kernel_checks.py).

Legend: B batch, T time, P pools, L k-pool length.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import indexer_scores as idx_mod
from glm53.kernels.indexer_scores import indexer_scores, indexer_scores_reference
from tests.helpers.kernel_checks import (
    FP32_TOL,
    LAYOUTS,
    assert_all_close,
    cu_for,
    grads,
    pool_starts_for,
)


@pytest.mark.parametrize("min_chunk", [1, 64], ids=["3-per-chunk", "min-64"])
@pytest.mark.parametrize("T,P", [(1, 1), (37, 10), (70, 17)], ids=["T1-P1", "T37-P10", "T70-P17"])
def test_indexer_scores_chunked_equals_reference(T, P, min_chunk, monkeypatch):
    monkeypatch.setattr(idx_mod, "SCORE_BUDGET", 3 * 2 * 4 * P)  # 3 queries per chunk (B = 2) ...
    monkeypatch.setattr(idx_mod, "MIN_SCORE_CHUNK", min_chunk)  # ... unless the floor is higher
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, T, 4, 8, generator=gen, requires_grad=True)
    w = torch.randn(2, T, 4, generator=gen, requires_grad=True)
    keys = torch.randn(2, P, 8, generator=gen, requires_grad=True)
    ref = indexer_scores_reference(q, w, keys, 8**-0.5)
    got = indexer_scores(q, w, keys, 8**-0.5)
    assert_all_close((got,), (ref,), dict(rtol=1e-6, atol=1e-6), ["scores"])
    assert_all_close(grads(got, [q, w, keys]), grads(ref, [q, w, keys]), FP32_TOL, ["dq", "dw", "dkeys"])


def test_indexer_selects_same_pools_on_both_backends(monkeypatch):
    """The indexer's chosen index sets do not depend on the scores backend (sets: topk order may differ on ties)."""
    from glm53 import Glm53Config
    from glm53.kernels import use_backend
    from glm53.model.indexer import Indexer

    config = Glm53Config.tiny(index_topk=8, index_kpool=4)
    indexer = Indexer(config)
    torch.nn.init.normal_(indexer.index_kpool_compress_ape)
    for p in (indexer.wq_b.weight, indexer.wk.weight, indexer.weights_proj.weight):
        torch.nn.init.normal_(p)
    monkeypatch.setattr(idx_mod, "SCORE_BUDGET", 64)
    x, q_resid = torch.randn(2, 45, config.hidden_size), torch.randn(2, 45, config.q_lora_rank)
    valid = torch.ones(2, 45, dtype=torch.bool)
    valid[1, :9] = False
    fast = indexer(x, q_resid, valid)
    with use_backend("reference", ["indexer_scores", "indexer_topk_pools"]):
        ref = indexer(x, q_resid, valid)
    assert torch.equal(fast.sort(-1).values, ref.sort(-1).values)
    assert (fast[1, :9] == -1).all() and (fast >= 0).any()


# ---------------------------------------------------------------------------------------- packed documents (cu_seqlens)
@pytest.mark.parametrize("small_chunks", [False, True], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("layout", ["B1-short-docs", "B2-rows"])
def test_indexer_scores_packed_matches_per_document_reference(layout, small_chunks, monkeypatch):
    B, T, lengths = LAYOUTS[layout]
    if small_chunks:  # chunks of queries that start and end inside documents
        monkeypatch.setattr(idx_mod, "MIN_PACKED_CHUNK", 5)
        monkeypatch.setattr(idx_mod, "SCORE_BUDGET", 5 * B * 4 * 40)
    gen = torch.Generator().manual_seed(6)
    starts = pool_starts_for(lengths, B, T, 4)
    q = torch.randn(B, T, 4, 8, generator=gen, requires_grad=True)
    w = torch.randn(B, T, 4, generator=gen, requires_grad=True)
    keys = torch.randn(B, starts.shape[1], 8, generator=gen, requires_grad=True)
    cu = cu_for(lengths)
    ref = indexer_scores_reference(q, w, keys, 0.35, cu_seqlens=cu, pool_start=starts)
    got = indexer_scores(q, w, keys, 0.35, cu_seqlens=cu, pool_start=starts)
    assert_all_close((got,), (ref,), FP32_TOL, ["scores"])
    assert_all_close(grads(got, [q, w, keys]), grads(ref, [q, w, keys]), FP32_TOL, ["dq", "dw", "dkeys"])
    # a query scores exactly its own document's pools: the rest are 0, and inside its document the unpacked scores
    full = indexer_scores_reference(q, w, keys, 0.35)
    own = (starts[:, None, :] >= 0) & (ref != 0)
    torch.testing.assert_close(ref[own], full[own])
    assert (ref != 0).sum() < (full != 0).sum()
