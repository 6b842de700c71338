"""The fused indexer pool choice (kernels/indexer_topk.py): the blocked form equals the reference exactly at these
shapes (exact ties included: their GEMMs round alike here), the Indexer's forward equals its `score_and_select`
top-k, and no intermediate grows as [T, P].

Legend (glm53/model/__init__.py): B batch, T queries, H indexer heads, K head width, P k-pools, Tq a block of
queries; `select` pools picked per query. The kernel takes no gradient (the selection never does), so parity is
on the outputs only.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm53 import Glm53Config
from glm53.kernels import indexer_topk as topk_mod
from glm53.kernels import use_backend
from glm53.kernels.indexer_topk import indexer_topk_pools, indexer_topk_pools_reference
from tests.helpers.modules import random_indexer

B, H, K = 2, 4, 8


def inputs(T: int, P: int, kpool: int, seed: int = 0):
    """Random queries and pool keys with exact ties: head 0's weight is 0 in odd queries and pool keys repeat in
    pairs, so equal scores (and all-zero ReLU sums) compete for the last picks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    w = torch.randn(B, T, H, generator=g)
    w[:, 1::2, 0] = 0.0
    keys = torch.randn(B, (P + 1) // 2, K, generator=g).repeat_interleave(2, dim=1)[:, :P]
    pool_end = (torch.arange(P) * kpool + kpool - 1).expand(B, P).clone()
    pool_end[1] += 3  # row 1 starts later (left padding)
    complete = torch.ones(B, P, dtype=torch.bool)
    complete[1, -2:] = False  # its last pools run past the sequence
    return q, w, keys, pool_end, complete


@pytest.mark.parametrize("offset", [0, 13])
@pytest.mark.parametrize(
    "T,P,select",
    [(1, 1, 1), (37, 10, 2), (70, 17, 4), (70, 17, 17), (9, 5, 0)],
    ids=["T1-P1", "T37-P10", "T70-P17", "select-all", "select-none"],
)
def test_blocked_equals_reference_exactly(T, P, select, offset, monkeypatch):
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 3 * B * H * P)  # 3 queries per block ...
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 3)  # ... many blocks, with partial causal horizons
    q, w, keys, pool_end, complete = inputs(T, P, kpool=3)
    ref = indexer_topk_pools_reference(q, w, keys, 0.35, pool_end, complete, offset, select)
    got = indexer_topk_pools(q, w, keys, 0.35, pool_end, complete, offset, select)
    assert torch.equal(got[1], ref[1])  # which slots hold a candidate
    assert torch.equal(got[0], ref[0])  # and which pool, in topk's order
    if select and T > 1 and offset == 0:
        assert ref[1].any() and not ref[1].all()  # early queries see fewer than `select` pools


def test_blocked_keeps_no_query_by_pool_tensor(monkeypatch):
    """Every intermediate of the blocked form is at most one block's [B, Tq, H, P] logits: never [B, T, P]."""
    T, P, block = 400, 40, 16
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", block * B * H * P)
    q, w, keys, pool_end, complete = inputs(T, P, kpool=8)
    largest = LargestOutput()
    with largest:  # the op's body: a dispatch mode sees a custom op as one call
        topk_mod._topk_pools(q, w, keys, 0.35, pool_end, complete, 0, 4)
    assert largest.numel == B * block * H * P  # the chunking parameter is honoured ...
    assert largest.numel < B * T * P / 4  # ... and far below the [B, T, P] scores the reference builds
    with largest:
        indexer_topk_pools_reference(q, w, keys, 0.35, pool_end, complete, 0, 4)
    assert largest.numel >= B * T * H * P  # the measure sees the reference's [B, T, H, P] logits


class GemmColumns(TorchDispatchMode):
    """The column count of every bmm over the K-wide pool keys inside the block (the blocked form's one scoring
    GEMM per block; the head-weighted sum is a bmm over H rows)."""

    def __enter__(self):
        self.columns = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default and args[1].shape[-2] == K:
            self.columns.append(args[1].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("offset", [0, 13])
def test_blocked_scores_only_the_pools_a_block_can_see(offset, monkeypatch):
    """Blocks of 4 queries score the leading pools up to the last complete one their last query sees (pool ends
    3p + 2 fall between block ends, so counting the next block's first query shows); an incomplete pool that ends
    early (row 0's last) adds no column."""
    T, P, step = 30, 12, 4
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", step * B * H * P)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", step)
    q, w, keys, pool_end, complete = inputs(T, P, kpool=3)
    complete[0, -1] = False
    gemms = GemmColumns()
    with gemms:
        topk_mod._topk_pools(q, w, keys, 0.35, pool_end, complete, offset, 3)
    expected = []
    for t0 in range(0, T, step):
        last = min(t0 + step, T) - 1 + offset
        seen = [p + 1 for b in range(B) for p in range(P) if complete[b, p] and pool_end[b, p] <= last]
        expected += [max(seen)] if seen else []
    assert gemms.columns == expected and expected[0] < expected[-1]  # early blocks see only a few pools


class LargestOutput(TorchDispatchMode):
    """Records the largest element count of any tensor an op returns inside the block."""

    def __enter__(self):
        self.numel = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_bad_pool_shapes_name_the_argument():
    q, w, keys, pool_end, complete = inputs(5, 4, kpool=2)
    with pytest.raises(ValueError, match="pool_end and complete"):
        indexer_topk_pools(q, w, keys, 1.0, pool_end[:, :3], complete, 0, 1)
    with pytest.raises(ValueError, match="select must be in"):
        indexer_topk_pools(q, w, keys, 1.0, pool_end, complete, 0, 5)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_indexer_forward_equals_score_and_select(padded, monkeypatch):
    """The fused forward returns score_and_select's top-k exactly, on either backend of the fused op."""
    monkeypatch.setattr(topk_mod, "TOPK_BUDGET", 1)
    monkeypatch.setattr(topk_mod, "MIN_TOPK_CHUNK", 5)
    config = Glm53Config.tiny(index_topk=8, index_kpool=4, index_n_heads=4)
    indexer, g = random_indexer(4, index_topk=8, index_kpool=4, index_n_heads=4), torch.Generator().manual_seed(5)
    T = 45
    x, q_resid = torch.randn(2, T, config.hidden_size, generator=g), torch.randn(2, T, config.q_lora_rank, generator=g)
    valid = torch.ones(2, T, dtype=torch.bool)
    if padded:
        valid[1, :9] = False
    with torch.no_grad():
        whole = indexer.score_and_select(x, q_resid, valid)
        fused = indexer(x, q_resid, valid)
        with use_backend("reference", ["indexer_topk_pools"]):
            reference = indexer(x, q_resid, valid)
    assert torch.equal(fused, whole[0]) and torch.equal(reference, whole[0])
    assert (whole[2] & ~whole[3]).any()  # sparse: some candidate pool is left out
