"""The fast attention and indexer-score kernels never read a device value inside their chunk loops (no host sync
per chunk) and stay single custom-op calls under torch.compile(fullgraph=True), forward and backward.

Legend: B batch, T queries, S keys, H heads, K head width, J selected slots per query, P pools.
The loop check runs each kernel's implementation on meta tensors, which hold no values: an `.item()`, `.tolist()`
or `int(tensor)` anywhere in the loop raises. The absorbed form's key spans (one transfer per call, before the
loop) are computed from the real indices and handed in, and the test counts that they are asked for once.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import indexer_scores as idx_mod
from glm53.kernels import sparse_attention as sa_mod
from tests.helpers.kernel_checks import FP32_TOL, assert_all_close, grads, sparse_inputs

SHAPE = (2, 40, 40, 3, 8, 6, 7)  # B, T, S, H, K, V, J: 40 queries in chunks of 3 -> 14 chunks


def on_meta(*xs):
    return [x.detach().to("meta") for x in xs]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(sa_mod, "GATHER_BUDGET", 1)
    monkeypatch.setattr(sa_mod, "MIN_QUERY_CHUNK", 3)
    monkeypatch.setattr(idx_mod, "SCORE_BUDGET", 1)
    monkeypatch.setattr(idx_mod, "MIN_SCORE_CHUNK", 3)


def spans_asked_once(monkeypatch, idx, num_keys, step):
    """Hand the per-call key spans (computed from the real indices) to a meta run; returns the list of requests."""
    spans, asked = sa_mod._mqa_chunk_spans(idx, num_keys, step), []
    monkeypatch.setattr(sa_mod, "_mqa_chunk_spans", lambda *a: asked.append(a[2]) or spans)
    return asked


@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
def test_per_head_loop_reads_no_device_value(small_chunks, span_ratio, monkeypatch):
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    (q, k, v), idx = sparse_inputs(*SHAPE, dtype=torch.float32)
    asked = spans_asked_once(monkeypatch, idx, k.shape[1], 3)
    q, k, v, idx = on_meta(q, k, v, idx)
    assert sa_mod._sparse_forward(q, k, v, idx, 0.3).shape == (*q.shape[:-1], v.shape[-1])
    dq, dk, dv = sa_mod._sparse_backward(q, k, v, idx, torch.empty_like(q[..., :1]).expand(*q.shape[:-1], 6), 0.3)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert asked == [3, 3]  # one span transfer per forward and per backward, not one per chunk


# One tensor-parallel rank's share of the released MLA (8 of 64 heads x 256, J = 2048 + a 3-token tail) over a
# 4096-key causal prefix: one query's gathered keys alone exceed GATHER_BUDGET, the regime where a budget-only
# chunk would hold a single query. Meta tensors: the shapes cost nothing.
RELEASED_PER_HEAD = dict(B=1, T=40, S=4096, H=8, K=256, J=2051)


@pytest.mark.parametrize("span_ratio", [-1, sa_mod.PER_HEAD_DENSE_SPAN_RATIO], ids=["gather", "default-ratio"])
def test_per_head_released_widths_chunks_many_queries(span_ratio, monkeypatch):
    """With the module's own budgets and at the released widths, the loop runs chunks of MIN_QUERY_CHUNK queries or
    more (never one per query), reads no device value, and asks for the key spans once per call."""
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    B, T, S, H, K, J = RELEASED_PER_HEAD.values()
    g = torch.Generator().manual_seed(0)
    pos = S - T + torch.arange(T)  # the last T queries of the sequence: each sees up to S keys, J of them selected
    idx = (torch.rand(T, S, generator=g) * (torch.arange(S) <= pos[:, None])).topk(J, dim=-1).indices[None]
    step = sa_mod._query_chunk(B, H, J, K)
    assert step == sa_mod.MIN_QUERY_CHUNK
    asked = spans_asked_once(monkeypatch, idx, S, step)
    chunks = []  # (queries, keys or slots) of each chunk: either path computes its probabilities once per chunk
    for name, arg in (("_chunk_probs", 2), ("_mqa_dense_probs", 0)):  # idx_c [B, Tq, J]; scores [B, H, Tq, span]
        fn = getattr(sa_mod, name)
        monkeypatch.setattr(sa_mod, name, lambda *a, fn=fn, i=arg: chunks.append(a[i].shape[-2:]) or fn(*a))
    q, k, v = (torch.empty(B, n, H, K, device="meta") for n in (T, S, S))
    o = sa_mod._sparse_forward(q, k, v, idx.to("meta"), 0.0625)
    grads_ = sa_mod._sparse_backward(q, k, v, idx.to("meta"), torch.empty_like(o), 0.0625)
    assert o.shape == q.shape and [x.shape for x in grads_] == [q.shape, k.shape, v.shape]
    assert asked == [step, step]
    queries, widths = [n for n, _ in chunks], {w for _, w in chunks}
    if span_ratio < 0:  # forward + backward: gather chunks of 16 queries (not 1), each holding J slots
        assert queries == [16, 16, 8] * 2 and widths == {J}
    else:  # the dense chunks merge into one over the whole key span (40 x 4096 x 8 scores, within DENSE_BUDGET)
        assert queries == [T, T] and J < min(widths) <= S


def test_per_head_chunk_plan_merges_dense_chunks_within_budget(monkeypatch):
    """The plan covers every query once, in order; merged dense chunks keep span <= PER_HEAD_DENSE_SPAN_RATIO * J,
    B * H * queries * span <= DENSE_BUDGET; gather chunks stay one step long; every selected key lies in its span."""
    B, T, S, H, J, step = 2, 200, 200, 2, 12, 8
    monkeypatch.setattr(sa_mod, "DENSE_BUDGET", B * H * 40 * 48)
    g = torch.Generator().manual_seed(3)
    local = torch.arange(T)[:, None] - torch.randint(0, 3 * J, (B, T, J), generator=g)  # recent keys: dense early
    far = torch.randint(0, T, (B, T, J), generator=g)  # anywhere: wide spans, gather
    idx = torch.where(torch.arange(T)[:, None] < 120, local, far).clamp(min=-1)
    idx[0, :30] = -1  # a run of all-empty rows
    plan = sa_mod._per_head_chunks(idx, S, step, H)
    assert [c[0] for c in plan] == [0] + [c[1] for c in plan[:-1]] and plan[-1][1] == T
    kinds = {True: 0, False: 0}
    for start, end, lo, hi, dense in plan:
        kinds[dense] += 1
        sel = idx[:, start:end]
        assert ((sel < 0) | ((sel >= lo) & (sel < hi))).all()
        if dense:
            assert hi - lo <= sa_mod.PER_HEAD_DENSE_SPAN_RATIO * J
            assert end - start == step or B * H * (end - start) * (hi - lo) <= sa_mod.DENSE_BUDGET
        else:
            assert end - start <= step
    assert kinds[True] and kinds[False] and max(c[1] - c[0] for c in plan) > step  # both kinds, some merged


@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
def test_absorbed_loop_reads_no_device_value(small_chunks, span_ratio, monkeypatch):
    monkeypatch.setattr(sa_mod, "DENSE_SPAN_RATIO", span_ratio)
    (q, k, _), idx = sparse_inputs(*SHAPE, dtype=torch.float32)
    kv = k[:, :, 0]
    asked = spans_asked_once(monkeypatch, idx, kv.shape[1], 3)
    q, kv, idx = on_meta(q, kv, idx)
    assert sa_mod._mqa_forward(q, kv, idx, 0.3).shape == q.shape
    dq, dkv = sa_mod._mqa_backward(q, kv, idx, torch.empty_like(q), 0.3)
    assert (dq.shape, dkv.shape) == (q.shape, kv.shape)
    assert asked == [3, 3]  # one span transfer per forward and per backward, not one per chunk


@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
def test_static_forms_read_nothing(small_chunks, span_ratio, monkeypatch):
    """The "static" backends (kernels/sparse_static.py) plan from shapes alone: forward and backward of both forms run
    on meta tensors with the span transfer unavailable, every chunk spanning all S keys."""
    monkeypatch.setattr(sa_mod, "DENSE_SPAN_RATIO", span_ratio)
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    monkeypatch.setattr(sa_mod, "_mqa_chunk_spans", lambda *a: pytest.fail("a static form asked for key spans"))
    spans = []
    dense_mask = sa_mod._mqa_dense_mask
    monkeypatch.setattr(sa_mod, "_mqa_dense_mask", lambda i, lo, n: spans.append((lo, n)) or dense_mask(i, lo, n))
    (q, k, v), idx = sparse_inputs(*SHAPE, dtype=torch.float32)
    q, k, v, idx = on_meta(q, k, v, idx)
    assert sa_mod._sparse_forward(q, k, v, idx, 0.3, static=True).shape == (*q.shape[:-1], v.shape[-1])
    do = torch.empty(*q.shape[:-1], v.shape[-1], device="meta")
    assert [x.shape for x in sa_mod._sparse_backward(q, k, v, idx, do, 0.3, static=True)] == [q.shape, k.shape, v.shape]
    kv = k[:, :, 0]
    assert sa_mod._mqa_forward(q, kv, idx, 0.3, static=True).shape == q.shape
    assert [x.shape for x in sa_mod._mqa_backward(q, kv, idx, torch.empty_like(q), 0.3, static=True)] == [
        q.shape,
        kv.shape,
    ]
    S = k.shape[1]
    assert set(spans) == (set() if span_ratio < 0 else {(0, S)})  # dense chunks cover every key


def test_indexer_scores_loop_reads_no_device_value(small_chunks):
    q, w, keys = (
        torch.empty(2, 40, 4, 8, device="meta"),
        torch.empty(2, 40, 4, device="meta"),
        torch.empty(2, 11, 8, device="meta"),
    )
    assert idx_mod._scores_forward(q, w, keys, 0.3).shape == (2, 40, 11)
    dq, dw, dkeys = idx_mod._scores_backward(q, w, keys, torch.empty(2, 40, 11, device="meta"), 0.3)
    assert (dq.shape, dw.shape, dkeys.shape) == (q.shape, w.shape, keys.shape)


def compiled_equals_eager(fn, leaves, *extra):
    torch._dynamo.reset()
    ref = fn(*leaves, *extra)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves, *extra)
    assert_all_close((got,), (ref,), FP32_TOL, ["out"])
    assert_all_close(grads(got, leaves), grads(ref, leaves), FP32_TOL, [f"d{i}" for i in range(len(leaves))])


def test_fast_kernels_compile_fullgraph_forward_and_backward(small_chunks):
    (q, k, v), idx = sparse_inputs(*SHAPE, dtype=torch.float32)
    compiled_equals_eager(sa_mod.sparse_attention, [q, k, v], idx, 0.3)
    kv = k[:, :, 0].detach().requires_grad_()
    compiled_equals_eager(sa_mod.sparse_mqa_attention, [q, kv], idx, 0.3)
    g = torch.Generator().manual_seed(0)
    q_i, w, keys = (torch.randn(*s, generator=g).requires_grad_() for s in ((2, 40, 4, 8), (2, 40, 4), (2, 11, 8)))
    compiled_equals_eager(idx_mod.indexer_scores, [q_i, w, keys], 8**-0.5)


def test_packed_indexer_scores_reads_pool_ranges_once(monkeypatch):
    """Packed documents: every chunk's pool columns come from one transfer before the loop, not one per chunk."""
    from tests.helpers.kernel_checks import LAYOUTS, cu_for, pool_starts_for

    B, T, lengths = LAYOUTS["B1-short-docs"]
    monkeypatch.setattr(idx_mod, "MIN_PACKED_CHUNK", 5)
    monkeypatch.setattr(idx_mod, "SCORE_BUDGET", 1)
    owned, calls = idx_mod._owned_pools, []
    monkeypatch.setattr(idx_mod, "_owned_pools", lambda *a: calls.append(len(owned(*a))) or owned(*a))
    starts = pool_starts_for(lengths, B, T, 4)
    g = torch.Generator().manual_seed(0)
    q, w, keys = (
        torch.randn(B, T, 4, 8, generator=g),
        torch.randn(B, T, 4, generator=g),
        torch.randn(B, starts.shape[1], 8, generator=g),
    )
    got = idx_mod.indexer_scores(q, w, keys, 0.35, cu_seqlens=cu_for(lengths), pool_start=starts)
    ref = idx_mod.indexer_scores_reference(q, w, keys, 0.35, cu_seqlens=cu_for(lengths), pool_start=starts)
    assert_all_close((got,), (ref,), FP32_TOL, ["scores"])
    assert len(calls) == 1 and calls[0] > 2  # one call for all (several) chunks
