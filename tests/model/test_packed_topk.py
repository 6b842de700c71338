"""The packed (cu_seqlens) top-k, blocked: `select_pools_blocked` with documents, and the Indexer's forward on a
packed batch, pick exactly the slots of the unblocked path (the packed [B, T, P] scores of kernel "indexer_scores",
then `select_pools`), and no tensor inside the blocked selection grows as [B, T, P].

Legend (glm53/model/__init__.py): B batch, T queries, S keys, H indexer heads, K head width, P k-pools, L tokens
per pool, J output slots, Tq a block of queries; `select` = index_topk / L pools picked per query.
Forced ties: pool keys repeat in pairs along the pool axis and head 0's weight is 0 in odd queries, so equal scores
compete for the last pick (select is odd) and ReLU sums of 0 tie; the tie rule (the earliest pool, #34) must give
the same pick blocked and unblocked. The selection has no gradient (made from detached scores): parity is on the
selected slots only, and it is exact (the scores are the same sums; their GEMMs round alike at these shapes).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.kernels import indexer_topk as topk_mod
from glm53.kernels import use_backend
from glm53.kernels.indexer_scores import indexer_scores
from glm53.kernels.indexer_topk import pool_starts
from glm53.kernels.varlen import own_document_pools
from glm53.model.indexer import kept_pools
from glm53.model.pool_selection import select_pools, select_pools_blocked
from tests.helpers.modules import random_indexer

H, K, SCALE = 4, 8, 8**-0.5
# Documents over B * S = 2 * 48 tokens: empty ones (duplicate boundaries, also at a row start and the end), one of a
# single token, ones shorter than a pool, and long ones spanning many query blocks.
CASES = {
    "empty-documents": [0, 0, 7, 7, 20, 48, 48, 60, 61, 96, 96],
    "short-documents": [0, 2, 3, 9, 11, 25, 30, 48, 50, 51, 53, 70, 96],
    "one-per-row": [0, 48, 96],
}


def packed_inputs(cu: list[int], L: int, S: int = 48, offset: int = 0, seed: int = 0):
    """Queries offset + [0, S - offset) of two rows of S keys packed as `cu`, with forced ties (module docstring);
    row 1 has a padding gap inside a document and row 0 left padding."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[0, :3] = False
    valid[1, 30:33] = False
    cu_seqlens = torch.tensor(cu)
    positions, complete = kept_pools(valid, L, cu_seqlens)
    P, T = positions.shape[1], S - offset
    q = torch.randn(2, T, H, K, generator=g)
    w = torch.randn(2, T, H, generator=g)
    w[:, 1::2, 0] = 0.0
    keys = torch.randn(2, (P + 1) // 2, K, generator=g).repeat_interleave(2, dim=1)[:, :P]
    return q, w, keys, positions, complete, valid, cu_seqlens


def unblocked_slots(q, w, keys, positions, complete, valid, cu, offset, topk, L, tail):
    """Today's packed path (Indexer.score_and_select): the [B, T, P] packed scores, then select_pools."""
    S = valid.shape[1]
    start = pool_starts(positions, S)
    if offset == 0:
        scores = indexer_scores(q, w, keys, SCALE, cu_seqlens=cu, pool_start=start)
    else:  # as under context parallelism: the plain scores of the rank's queries, other documents' pools masked
        scores = indexer_scores(q, w, keys, SCALE) * own_document_pools(start, cu, S, offset, q.shape[1])
    return scores, select_pools(scores, positions, complete, valid, cu, offset, topk, L, tail)


def boundary_ties(scores: torch.Tensor, candidate: torch.Tensor, selected: torch.Tensor) -> int:
    """Queries whose last pick ties with a candidate left out (the tie rule decides between them)."""
    lowest = scores.masked_fill(~selected, float("inf")).amin(-1, keepdim=True)
    return int((candidate & ~selected & (scores == lowest)).any(-1).sum())


@pytest.mark.parametrize("tail", [False, True], ids=["no-tail", "tail"])
@pytest.mark.parametrize("offset", [0, 20])
@pytest.mark.parametrize("case", CASES)
def test_packed_blocked_selection_equals_unblocked_exactly(case, offset, tail, monkeypatch):
    """Blocks of 5 queries (many blocks per document, blocks spanning documents) pick exactly today's slots, on
    both backends of kernel "indexer_topk_pools", eager and compiled (the op is opaque: fullgraph)."""
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 5)
    L, index_topk = 3, 9  # 3 pools per query: an odd pick count splits the tied pairs
    inputs = packed_inputs(CASES[case], L, offset=offset, seed=len(case) + offset)
    scores, (expected, candidate, selected) = unblocked_slots(*inputs, offset, index_topk, L, tail)
    args = (*inputs[:6], inputs[6], SCALE, offset, index_topk, L, tail)
    blocked = select_pools_blocked(*args)
    with use_backend("reference", ["indexer_topk_pools"]):
        reference = select_pools_blocked(*args)
    compiled = torch.compile(select_pools_blocked, fullgraph=True, backend="eager")(*args)
    assert torch.equal(blocked, expected)
    assert torch.equal(reference, expected) and torch.equal(compiled, expected)
    # the comparison has teeth: sparse choices, forced ties at the boundary, queries without any candidate
    assert (candidate & ~selected).any() and boundary_ties(scores, candidate, selected) > 0
    if offset == 0:  # the first tokens of a document see no complete pool of it
        assert (~candidate.any(-1) & inputs[5]).any()


def test_packed_candidates_are_the_query_documents_pools():
    """Each chosen pool of the blocked selection lies in its query's document and ends at or before the query."""
    L, index_topk = 3, 9
    q, w, keys, positions, complete, valid, cu = packed_inputs(CASES["short-documents"], L)
    topk = select_pools_blocked(q, w, keys, positions, complete, valid, cu, SCALE, 0, index_topk, L, False)
    bounds = cu.tolist()
    for b in range(2):
        for t in range(48):
            flat = b * 48 + t
            s, e = next((s, e) for s, e in zip(bounds[:-1], bounds[1:]) if s <= flat < e)
            got = topk[b, t][topk[b, t] >= 0] + b * 48
            assert ((got >= s) & (got <= flat)).all(), (b, t, got.tolist(), (s, e))
    assert (topk >= 0).sum() > 48  # many slots filled


class GemmColumns(TorchDispatchMode):
    """The column count of every bmm over the K-wide pool keys (the blocked form's one scoring GEMM per block)."""

    def __enter__(self):
        self.columns = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default and args[1].shape[-2] == K:
            self.columns.append(args[1].shape[-1])
        return func(*args, **(kwargs or {}))


def test_packed_blocks_score_only_their_documents_pools(monkeypatch):
    """A block of 6 queries scores the columns from the first to the last pool that is a candidate of one of its
    queries in some row (the hull of the reference's candidate mask over the block): with short documents far fewer
    columns than the leading pools up to that last one."""
    step, L, S = 6, 3, 48
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", step)
    q, w, keys, positions, complete, valid, cu = packed_inputs(CASES["short-documents"], L)
    pool_end = positions[..., -1].clamp(0, S - 1)
    start, query_start = topk_mod.document_starts(positions, cu, S, 0, S)
    gemms = GemmColumns()
    with gemms:
        topk_mod._topk_pools(q, w, keys, SCALE, pool_end, complete, 0, 3, start, query_start)
    candidate = topk_mod._candidates(pool_end, complete, torch.arange(S), start, query_start)  # [B, T, P]
    expected, horizon = [], []
    for t0 in range(0, S, step):
        pools = candidate[:, t0 : t0 + step].any(1).any(0).nonzero().flatten().tolist()
        expected += [pools[-1] + 1 - pools[0]] if pools else []
        horizon += [pools[-1] + 1] if pools else []
    assert gemms.columns == expected
    assert sum(expected) < sum(horizon)  # 40 columns against 76 leading ones here


def test_packed_arguments_are_checked():
    q, w, keys, positions, complete, valid, cu = packed_inputs(CASES["empty-documents"], 3)
    pool_end = positions[..., -1].clamp(0, 47)
    start, query_start = topk_mod.document_starts(positions, cu, 48, 0, 48)
    for kernel in (topk_mod.indexer_topk_pools, topk_mod.indexer_topk_pools_reference):
        with pytest.raises(ValueError, match="both pool_start and query_start"):
            kernel(q, w, keys, SCALE, pool_end, complete, 0, 2, start, None)
        with pytest.raises(ValueError, match=r"query_start of shape \(2, 48\)"):
            kernel(q, w, keys, SCALE, pool_end, complete, 0, 2, start, query_start[:, 1:])


class LargestInside(TorchDispatchMode):
    """The largest element count of any tensor an ATen op returns inside the block, custom ops (glm53::*) entered:
    their CPU kernel runs under this mode, so the ops inside them are counted too."""

    def __enter__(self):
        self.numel = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "glm53":
            with self:
                kernel = torch.library.get_kernel(func, "CPU")
                return kernel.call_boxed(torch._C.DispatchKeySet("CPU"), *args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_packed_blocked_selection_makes_no_query_by_pool_tensor(monkeypatch):
    """Inside the packed blocked selection nothing reaches [B, T, P] elements: at most one block's [B, Tq, H, p]
    logits, its [B, Tq, P] rows, the [B, T, J] slots and per-block column spans; the same measure sees today's
    path's [B, T, P] (the scores alone, before the selection's own [B, T, P] masks)."""
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 8)
    L, index_topk, S = 2, 8, 240
    cu = [0, 0, 37, 100, 101, 180, 240, 300, 300, 410, 480]
    q, w, keys, positions, complete, valid, cu_seqlens = packed_inputs(cu, L, S=S)
    B, P = 2, positions.shape[1]
    full = B * S * P
    largest = LargestInside()
    with largest:
        select_pools_blocked(q, w, keys, positions, complete, valid, cu_seqlens, SCALE, 0, index_topk, L, True)
    # the largest is one block's logits [B, 8 H, p] <= 2 * 32 * P, or [B, T, J] (J = 9), or [B, S / 8, P] spans
    assert largest.numel <= max(B * 8 * H * P, B * S * (index_topk + L - 1), B * (S // 8) * P) < full / 4
    with largest:
        unblocked_slots(q, w, keys, positions, complete, valid, cu_seqlens, 0, index_topk, L, True)
    assert largest.numel >= full


@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_forward_on_a_packed_batch_equals_score_and_select(seed, monkeypatch):
    """The Indexer's packed forward (blocked) returns score_and_select's top-k exactly; constant token runs make
    identical pools (exact ties) inside documents, and padding tokens sit inside one."""
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 4)
    indexer = random_indexer(seed, index_topk=12, index_kpool=4, index_n_heads=4)  # 3 pools per query
    g = torch.Generator().manual_seed(seed)
    S = 64
    x, q_resid = torch.randn(2, S, 32, generator=g), torch.randn(2, S, 24, generator=g)
    x[:, 24:40] = x[:, 24:25]  # 16 equal tokens: identical pools in document [20, 64) of row 0 and [80, 128)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, 50:53] = False
    cu = torch.tensor([0, 5, 5, 20, 64, 64, 80, 128, 128])
    with torch.no_grad():
        whole = indexer.score_and_select(x, q_resid, valid, cu_seqlens=cu)
        blocked = indexer(x, q_resid, valid, cu)
    assert torch.equal(blocked, whole[0])
    assert boundary_ties(*whole[1:]) > 0 and (whole[2] & ~whole[3]).any()
