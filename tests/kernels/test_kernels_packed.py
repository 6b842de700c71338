"""Every fast kernel with packed-document boundaries (`cu_seqlens`) equals its reference with the same boundaries
(forward and all gradients); the references run each document alone.

Boundaries cover documents of length 1 and 2, one short of a fast KDA chunk, longer than a chunk, and two rows
(B = 2) with boundaries over the flattened tokens (every row start is a boundary).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels import indexer_scores as idx_mod
from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.conv import causal_conv1d, causal_conv1d_reference
from glm53.kernels.indexer_scores import indexer_scores, indexer_scores_reference
from glm53.kernels.kda import chunk as kda_mod
from glm53.kernels.kda import kda_chunk, kda_chunk_reference, kda_recurrent_reference
from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)
from tests.kernels.test_kernels_fast import FP32_TOL, assert_all_close, grads, kda_inputs

C = kda_mod.FAST_CHUNK_SIZE
# (B, T, document lengths over the flattened B * T tokens; every row start must be among the boundaries)
LAYOUTS = {
    "B1-short-docs": (1, 2 * C + 9, [1, 2, C - 1, C + 6, 1]),
    "B2-rows": (2, C + 5, [3, C + 2, 1, C - 1, 5]),
    "B1-one-doc": (1, C + 3, [C + 3]),
}


def cu_for(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def packed_kda_inputs(B, T, gate):
    """kda_inputs; "weak": decays of at most -0.1 per step, so a state that leaks across a boundary (or over a
    chunk) is still large enough to see (the -5 bounded gate forgets within a chunk)."""
    xs = kda_inputs(B, T, 2, 8, 6, "bounded" if gate == "weak" else gate)[:5]
    if gate == "weak":
        xs[3] = (xs[3].detach() * 0.02).requires_grad_()
    return xs


@pytest.mark.parametrize("gate", ["weak", "bounded", "softplus-large"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kda_packed_matches_per_document_reference(layout, gate):
    B, T, lengths = LAYOUTS[layout]
    cu = cu_for(lengths)
    xs = packed_kda_inputs(B, T, gate)
    ref, _ = kda_recurrent_reference(*xs, cu_seqlens=cu)
    got, state = kda_chunk(*xs, cu_seqlens=cu)
    assert state is None
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta"])
    chunked, _ = kda_chunk_reference(*xs, cu_seqlens=cu, chunk_size=16)
    assert_all_close((chunked,), (ref,), dict(rtol=1e-4, atol=2e-5), ["o (chunk reference)"])


def test_kda_packed_reference_is_documents_alone():
    """The reference's packed form against explicit runs of each document (the definition), and the state
    really restarts: without the boundaries the outputs differ."""
    xs = packed_kda_inputs(1, 40, "weak")
    cu = cu_for([7, 33])
    got, _ = kda_recurrent_reference(*xs, cu_seqlens=cu)
    second, _ = kda_recurrent_reference(*(x[:, 7:] for x in xs))
    torch.testing.assert_close(got[:, 7:], second)
    assert not torch.allclose(kda_recurrent_reference(*xs)[0][:, 7:], second, atol=1e-3)


def test_kda_packed_rejects_states():
    xs = kda_inputs(1, 8, 1, 4, 4, "bounded")
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(*xs[:5], initial_state=xs[5], cu_seqlens=cu_for([3, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at 8"):
        kda_chunk(*xs[:5], cu_seqlens=cu_for([3, 4]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conv_packed_matches_per_document_reference(layout):
    B, T, lengths = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 12, generator=gen, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, requires_grad=True)
    cu = cu_for(lengths)
    ref, _ = causal_conv1d_reference(x, w, cu_seqlens=cu)
    got, _ = causal_conv1d(x, w, cu_seqlens=cu)
    assert_all_close((got,), (ref,), FP32_TOL, ["y"])
    assert_all_close(grads(got, [x, w]), grads(ref, [x, w]), FP32_TOL, ["dx", "dweight"])
    # each document alone, through the unpacked fast conv
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        b, s0 = divmod(s, T)
        alone, _ = causal_conv1d(x[b : b + 1, s0 : s0 + e - s], w)
        torch.testing.assert_close(got[b : b + 1, s0 : s0 + e - s], alone, rtol=1e-5, atol=1e-6)


def random_topk(B: int, T: int, J: int, gen: torch.Generator) -> torch.Tensor:
    """Causal, distinct key positions per query (some slots empty), spread over the whole row."""
    idx = torch.full((B, T, J), -1, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            keys = torch.randperm(t + 1, generator=gen)[:J]
            idx[b, t, : keys.numel()] = keys
    return idx


@pytest.mark.parametrize("layout", ["B1-short-docs", "B2-rows"])
def test_sparse_attention_packed_matches_per_document_reference(layout, monkeypatch):
    """Both chunk kinds of the per-head form run, chunks of 5 queries crossing the document boundaries."""
    monkeypatch.setattr(sa_mod, "GATHER_BUDGET", 1)
    monkeypatch.setattr(sa_mod, "MIN_QUERY_CHUNK", 5)
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", 4)  # J = 3: dense only within 12 keys
    B, T, lengths = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(B, T, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, 2, 6, generator=gen, requires_grad=True)
    cu = cu_for(lengths)
    for J in (3, 40):  # J = 3: early chunks dense (some merged), later ones gathered; J = 40: all dense
        topk = random_topk(B, T, J, gen)
        ref = sparse_attention_reference(q, k, v, topk, 0.3, cu_seqlens=cu)
        got = sparse_attention(q, k, v, topk, 0.3, cu_seqlens=cu)
        assert_all_close((got,), (ref,), FP32_TOL, [f"o J={J}"])
        assert_all_close(grads(got, [q, k, v]), grads(ref, [q, k, v]), FP32_TOL, [f"d{n} J={J}" for n in "qkv"])


@pytest.mark.parametrize("layout", ["B1-short-docs", "B2-rows"])
def test_sparse_mqa_attention_packed_matches_per_document_reference(layout):
    """Both of the fast form's chunk kinds run: masked-dense chunks (a document's keys within 4 J) and gathered."""
    B, T, lengths = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, 3, 10, generator=gen, requires_grad=True)
    kv = torch.randn(B, T, 10, generator=gen, requires_grad=True)
    cu = cu_for(lengths)
    for J in (3, 40):  # J = 3: late chunks span more than 4 J keys (gather); J = 40: every chunk dense
        topk = random_topk(B, T, J, gen)
        ref = sparse_mqa_attention_reference(q, kv, topk, 0.3, cu_seqlens=cu)
        got = sparse_mqa_attention(q, kv, topk, 0.3, cu_seqlens=cu)
        assert_all_close((got,), (ref,), FP32_TOL, [f"o J={J}"])
        assert_all_close(grads(got, [q, kv]), grads(ref, [q, kv]), FP32_TOL, [f"dq J={J}", f"dkv J={J}"])


def pool_starts_for(lengths: list[int], B: int, T: int, L: int) -> torch.Tensor:
    """Pools from each document's start (L apart), rows padded with T; the layout the indexer builds."""
    rows: list[list[int]] = [[] for _ in range(B)]
    pos = 0
    for n in lengths:
        b, s = divmod(pos, T)
        rows[b] += list(range(s, s + n, L))
        pos += n
    P = max(len(r) for r in rows)
    return torch.tensor([r + [T] * (P - len(r)) for r in rows])


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
