"""The query-offset paths context parallelism uses, on one process: queries that are a slice [offset, offset + T)
of the keys' sequence give exactly that slice of the whole computation.

- `Indexer.select` and `Indexer.visible_tail` with `query_offset` (plain, padded, packed rows);
- `attention_pool_mass` with `query_offset` (also across its query chunks);
- `own_document_pools`: the packed `indexer_scores` column mask, by rows;
- key_sequence.py: `segment_boundaries` equals the model's `document_boundaries`, `same_document_slots` the packed
  kernels' `same_document_only`;
- MLA rejects a generation cache under context parallelism.

Legend (glm53/model/__init__.py): B batch, S keys (the whole sequence), T queries, P k-pools.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config
from glm53.kernels.sparse_attention import same_document_only
from glm53.model import attention_mass as losses
from glm53.model.context import ForwardContext
from glm53.model.indexer import Indexer, own_document_pools, pool_starts
from glm53.model.key_sequence import KeySequence, same_document_slots, segment_boundaries
from glm53.model.mla import MultiHeadLatentAttention
from glm53.model.packing import document_boundaries
from glm53.model.packing import segment_ids as segment_ids_of
from tests.helpers.modules import random_indexer

B, S = 2, 37
SLICES = [(0, 9), (9, 10), (19, 18)]  # (offset, length): uneven, covering [0, S)
DOCS = [[6, 14, 17], [9, 3, 25]]  # document lengths per row; row 1's [9, 12) is padding


def layout(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """valid [B, S] and cu_seqlens over B * S (None: one document per row)."""
    valid = torch.ones(B, S, dtype=torch.bool)
    if name == "padded":
        valid[0, :5] = False
        valid[1, :23] = False
        return valid, None
    if name == "plain":
        return valid, None
    valid[0, 0] = False
    valid[1, 9:12] = False
    lengths = [n for row in DOCS for n in row]
    return valid, torch.tensor([0, *lengths]).cumsum(0)


@pytest.fixture(scope="module")
def indexer() -> Indexer:
    return random_indexer(2, index_kpool=4, index_topk=8, index_n_heads=16)


@pytest.mark.parametrize("name", ["plain", "padded", "packed"])
def test_select_and_tail_with_offset_are_rows_of_the_whole(indexer, name):
    valid, cu = layout(name)
    g = torch.Generator().manual_seed(3)
    x, q_resid = torch.randn(B, S, 32, generator=g), torch.randn(B, S, 24, generator=g)
    with torch.no_grad():
        pool_keys, positions, complete = indexer.pools(x, valid, cu)
        start = None if cu is None else pool_starts(positions, S)
        scores = indexer.scores(x, q_resid, pool_keys, cu, start)
        whole = indexer.select(scores, positions, complete, valid, cu)
        tail = indexer.visible_tail(valid, cu)
        assert (whole[1] & ~whole[2]).any()  # sparse: some candidate pool is left out
        for offset, n in SLICES:
            rows = slice(offset, offset + n)
            part = indexer.select(scores[:, rows], positions, complete, valid, cu, query_offset=offset)
            for a, b, what in zip(part, whole, ("topk", "candidate", "selected")):
                assert torch.equal(a, b[:, rows]), what
            assert torch.equal(indexer.visible_tail(valid, cu, offset, n), tail[:, rows])


@pytest.mark.parametrize("chunk", [1024, 4], ids=["one-chunk", "chunks-of-4"])
@pytest.mark.parametrize("name", ["plain", "padded", "packed"])
def test_attention_pool_mass_with_offset_is_rows_of_the_whole(name, chunk, monkeypatch):
    monkeypatch.setattr(losses, "QUERY_CHUNK", chunk)
    valid, cu = layout(name)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(B, S, 2, 8, generator=g), torch.randn(B, S, 2, 8, generator=g)
    whole = losses.attention_pool_mass(q, k, valid, 4, 0.4, cu_seqlens=cu)
    for offset, n in SLICES:
        rows = slice(offset, offset + n)
        part = losses.attention_pool_mass(q[:, rows], k, valid, 4, 0.4, cu_seqlens=cu, query_offset=offset)
        torch.testing.assert_close(part, whole[:, rows], rtol=1e-6, atol=1e-7)


def test_own_document_pools_is_the_packed_scores_mask(indexer):
    valid, cu = layout("packed")
    g = torch.Generator().manual_seed(5)
    x, q_resid = torch.randn(B, S, 32, generator=g), torch.randn(B, S, 24, generator=g)
    with torch.no_grad():
        pool_keys, positions, _ = indexer.pools(x, valid, cu)
        start = pool_starts(positions, S)
        packed = indexer.scores(x, q_resid, pool_keys, cu, start)
        plain = indexer.scores(x, q_resid, pool_keys)
    for offset, n in SLICES:
        rows = slice(offset, offset + n)
        mask = own_document_pools(start, cu, S, offset, n)
        assert mask.any() and not mask.all()
        # the two forms block the fp32 score GEMMs differently; every reduction feeding a score is at most
        # 2 * D = 64 terms long, so an entry can move by 64 eps times the scores' size (an entry near zero has
        # no relative bound: the old rtol=1e-5, atol=0 failed with ATen's default kernels at 1.4e-5)
        atol = 2 * 32 * torch.finfo(torch.float32).eps * plain.abs().max().item()
        torch.testing.assert_close(plain[:, rows] * mask, packed[:, rows], rtol=0, atol=atol)


def test_segment_boundaries_match_the_models_boundaries():
    _, cu = layout("packed")
    ids = segment_ids_of(cu, B, S) * 7 + 3  # any labels: only where they change matters
    assert torch.equal(segment_boundaries(ids), document_boundaries(B, S, torch.device("cpu"), cu_seqlens=cu))
    assert segment_boundaries(torch.zeros(B, S, dtype=torch.long)) is None  # one document per row


def test_same_document_slots_with_offset_are_rows_of_the_kernels_filter():
    valid, cu = layout("packed")
    g = torch.Generator().manual_seed(6)
    topk = torch.randint(-1, S, (B, S, 12), generator=g)
    whole = same_document_only(topk, cu, S)
    assert (whole != topk).any()
    for offset, n in SLICES:
        rows = slice(offset, offset + n)
        assert torch.equal(same_document_slots(topk[:, rows], KeySequence(valid, cu, offset)), whole[:, rows])
    assert same_document_slots(topk, KeySequence(valid, None, 0)) is topk


def test_mla_rejects_a_generation_cache_under_context_parallelism():
    layer = MultiHeadLatentAttention(Glm53Config.tiny(layer_types=["indexed_attention"] * 4), 0)
    ctx = ForwardContext(valid=torch.ones(1, 4, dtype=torch.bool), cache=object(), cp=object())
    with pytest.raises(ValueError, match="context parallelism"):
        layer(torch.randn(1, 4, 32), ctx)
