"""The per-head sparse attention's chunk plan (kernels/sparse_attention.py `_per_head_chunks`): which query chunks
run masked-dense, which merge, and over which key span, on selections whose spans move backwards and forwards.

Legend (glm53/model/__init__.py): B batch, T queries, S keys, H heads, K/V widths, J selected slots per query.
Chunks of 4 queries (GATHER_BUDGET 1, MIN_QUERY_CHUNK 4); a chunk is dense when its span is <= 4 * J = 12 keys.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.sparse_attention import sparse_attention, sparse_attention_reference
from tests.kernels.test_kernels_fast import FP32_TOL, assert_all_close, grads

B, T, S, H, J = 2, 28, 40, 2, 3
# key window [w0, w1) of each chunk of 4 queries: chunk 1 lies before chunk 0 (a merged span must reach back and
# keep chunk 0's end), chunk 2 is wide (gather), chunks 3-5 move back again, chunk 6's span is exactly 4 * J
WINDOWS = [(20, 26), (14, 20), (0, 30), (30, 34), (33, 37), (28, 32), (0, 12)]


def selection() -> torch.Tensor:
    """[B, T, J]: each query picks its window's first and last key and one inside; -1 holes and a slot past the
    keys (S + 2, empty like -1) that must not widen its chunk's span."""
    rows = []
    for t in range(T):
        w0, w1 = WINDOWS[t // 4]
        rows.append([w0, w1 - 1, w0 + 1 + t % (w1 - w0 - 2)])
    idx = torch.tensor(rows).expand(B, T, J).clone()
    idx[1, 1::2, 2] = -1
    idx[0, 17, 2] = S + 2
    return idx


@pytest.fixture
def chunking(monkeypatch):
    monkeypatch.setattr(sa_mod, "GATHER_BUDGET", 1)
    monkeypatch.setattr(sa_mod, "MIN_QUERY_CHUNK", 4)
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", 4)
    return monkeypatch


PLANS = {
    # 8 queries x 12 keys fit 400; chunks 3+4 (7 keys) fit, adding chunk 5 (12 x 9 x 4 = 432) does not
    400: [
        (0, 8, 14, 26, True),
        (8, 12, 0, 30, False),
        (12, 20, 30, 37, True),
        (20, 24, 28, 32, True),
        (24, 28, 0, 12, True),
    ],
    # no budget limit: chunks 3-5 merge (9 keys); chunk 6 would stretch the span to 37 > 12 keys
    1 << 20: [(0, 8, 14, 26, True), (8, 12, 0, 30, False), (12, 24, 28, 37, True), (24, 28, 0, 12, True)],
}


@pytest.mark.parametrize("budget", PLANS, ids=["budget-400", "no-budget"])
def test_per_head_plan_merges_within_span_and_budget(budget, chunking):
    chunking.setattr(sa_mod, "DENSE_BUDGET", budget)
    plan = sa_mod._per_head_chunks(selection(), S, sa_mod._query_chunk(B, H, J, 8), H)
    assert plan == PLANS[budget]


@pytest.mark.parametrize("budget", PLANS, ids=["budget-400", "no-budget"])
def test_per_head_merged_chunks_match_reference(budget, chunking):
    chunking.setattr(sa_mod, "DENSE_BUDGET", budget)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, H, 8, generator=gen, dtype=torch.float64).requires_grad_() for n in (T, S, S))
    idx = selection()
    ref = sparse_attention_reference(q, k, v, idx, 0.3)
    got = sparse_attention(q, k, v, idx, 0.3)
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert_all_close(grads(got, [q, k, v]), grads(ref, [q, k, v]), FP32_TOL, ["dq", "dk", "dv"])
