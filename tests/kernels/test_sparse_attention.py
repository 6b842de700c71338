"""The per-head sparse attention's chunk plan (kernels/sparse_attention.py `_per_head_chunks`): which query chunks
run masked-dense, which merge, and over which key span, on selections whose spans move backwards and forwards.

Legend (glm53/model/__init__.py): B batch, T queries, S keys, H heads, K/V widths, J selected slots per query.
Chunks of 4 queries (GATHER_BUDGET 1, MIN_QUERY_CHUNK 4); a chunk is dense when its span is <= 4 * J = 12 keys.

Packed sparse attention at the document edges: a slot on the NEXT document's first token or the PREVIOUS
document's last token is empty; a slot on the query's own first or last token is read.

Mutation audit (issue #34): letting a packed query attend the next document's first token (`<= end` in the
document filter) passed every test, which drew only causal slots (never at or past the query's own document end).
Here every query's slots are placed on purpose at start - 1, start, end - 1 and end of its document, and the
fast and reference forms of both the per-head and the absorbed (MQA) kernel are compared with each document run
alone on indices the test filters itself. The fast forms compute in fp32 whatever the input; the inputs are fp32
N(0, 1): a score is a length-K dot product whose fp32 error is at most K * eps * sum|q_i k_i| (<= 4 * 1.2e-7 * 16),
and the softmax over <= 4 slots times |v| <= 4 carries it to the output: atol = K * eps * 16 * 4 = 3.1e-5,
far below what reading one wrong token changes (O(0.1)).

Top-k sparse attention with fewer queries than keys (context parallelism: a rank's queries over the whole
sequence's keys): a slice of the queries, with their rows of top-k, gives that slice of the full output, and the
key/value gradients of the slices sum to the full ones. Both backends, both kernels, the dense-span and the
gather paths of the absorbed kernel (a narrow causal prefix and a wide sparse one).

Legend (glm53/model/__init__.py): B_SLICE batch, T queries, S_SLICE keys, H_SLICE heads, K_SLICE key width, V value width, Z latent width,
J selected slots.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import kernel, use_backend
from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)
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


# ----------------------------------------------------------------------------------------------------- packed documents
B_DOCS, T_DOCS, H_DOCS, K = 1, 12, 2, 4
CU = torch.tensor([0, 5, 9, 12])  # documents [0, 5), [5, 9), [9, 12)
FP32 = dict(rtol=0.0, atol=K * torch.finfo(torch.float32).eps * 16 * 4)


def edge_slots() -> torch.Tensor:
    """[B_DOCS, T_DOCS, 4]: per query, its document's start - 1, start, end - 1 and end (-1 where that is off the row)."""
    idx = torch.full((B_DOCS, T_DOCS, 4), -1, dtype=torch.long)
    for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
        for t in range(s, e):
            idx[0, t] = torch.tensor([s - 1, s, e - 1, e if e < T_DOCS else -1])
    return idx


def alone(attend, q, kvs, idx):
    """Each document run alone, with only its own slots (filtered here, independently of the kernels)."""
    out = []
    for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
        local = idx[:, s:e] - s
        local = torch.where((local >= 0) & (local < e - s), local, torch.full_like(local, -1))
        out.append(attend(q[:, s:e], *(x[:, s:e] for x in kvs), local, 0.5))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kernel", [sparse_attention, sparse_attention_reference], ids=["fast", "reference"])
def test_per_head_kernel_reads_only_the_own_documents_edge_tokens(kernel):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B_DOCS, T_DOCS, H_DOCS, K, generator=g, dtype=torch.float32) for _ in range(3))
    idx = edge_slots()
    got = kernel(q, k, v, idx, 0.5, cu_seqlens=CU)
    torch.testing.assert_close(got, alone(sparse_attention_reference, q, (k, v), idx), **FP32)
    # the next document's first token really is read when the slot is not filtered (the test can fail)
    assert not torch.allclose(got, sparse_attention_reference(q, k, v, idx, 0.5))


@pytest.mark.parametrize("kernel", [sparse_mqa_attention, sparse_mqa_attention_reference], ids=["fast", "reference"])
def test_absorbed_kernel_reads_only_the_own_documents_edge_tokens(kernel):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B_DOCS, T_DOCS, H_DOCS, K, generator=g, dtype=torch.float32)
    kv = torch.randn(B_DOCS, T_DOCS, K, generator=g, dtype=torch.float32)
    idx = edge_slots()
    got = kernel(q, kv, idx, 0.5, cu_seqlens=CU)
    torch.testing.assert_close(got, alone(sparse_mqa_attention_reference, q, (kv,), idx), **FP32)
    assert not torch.allclose(got, sparse_mqa_attention_reference(q, kv, idx, 0.5))


# ---------------------------------------------------------------------------------------------- fewer queries than keys
B_SLICE, S_SLICE, H_SLICE, K_SLICE, V, Z = 2, 48, 3, 8, 6, 10
SLICES = [(0, 11), (11, 20), (31, 17)]  # (offset, length): cover [0, S_SLICE) in uneven parts


def causal_topk(J: int, seed: int) -> torch.Tensor:
    """[B_SLICE, S_SLICE, J] random distinct visible keys per query (s <= t), -1 in the slots a short prefix cannot fill."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(B_SLICE, S_SLICE, S_SLICE, generator=g).masked_fill(
        ~torch.ones(S_SLICE, S_SLICE, dtype=torch.bool).tril(), -1.0
    )
    values, idx = noise.topk(J, dim=-1)
    return idx.masked_fill(values < 0, -1)


def run(op: str, q, kvs, topk, w):
    """Output and gradients of sum(out * w)."""
    q = q.clone().requires_grad_()
    kvs = [t.clone().requires_grad_() for t in kvs]
    out = kernel(op)(q, *kvs, topk, K_SLICE**-0.5)
    (out * w).sum().backward()
    return out.detach(), q.grad, [t.grad for t in kvs]


@pytest.mark.parametrize("J", [4, 40], ids=["J4-gather", "J40-dense-span"])
@pytest.mark.parametrize("op", ["sparse_attention", "sparse_mqa_attention"])
@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_query_slices_equal_full_rows(backend, op, J, monkeypatch):
    # the per-head form at the absorbed form's span ratio, so each J id names the same chunk path for both forms
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", sa_mod.DENSE_SPAN_RATIO)
    g = torch.Generator().manual_seed(0)
    if op == "sparse_attention":
        q, kvs = (
            torch.randn(B_SLICE, S_SLICE, H_SLICE, K_SLICE, generator=g),
            [
                torch.randn(B_SLICE, S_SLICE, H_SLICE, K_SLICE, generator=g),
                torch.randn(B_SLICE, S_SLICE, H_SLICE, V, generator=g),
            ],
        )
    else:
        q, kvs = torch.randn(B_SLICE, S_SLICE, H_SLICE, Z, generator=g), [torch.randn(B_SLICE, S_SLICE, Z, generator=g)]
    q, kvs = q.double(), [t.double() for t in kvs]
    topk = causal_topk(J, seed=J)
    w = torch.randn(B_SLICE, S_SLICE, H_SLICE, V if op == "sparse_attention" else Z, generator=g, dtype=torch.float64)
    tol = dict(rtol=1e-12, atol=1e-12) if backend == "fast" else dict(rtol=1e-5, atol=1e-6)  # the reference: fp32
    with use_backend(backend, [op]):
        full_out, full_dq, full_dkv = run(op, q, kvs, topk, w)
        summed = [torch.zeros_like(t) for t in kvs]
        for offset, n in SLICES:
            rows = slice(offset, offset + n)
            out, dq, dkv = run(op, q[:, rows], kvs, topk[:, rows], w[:, rows])
            torch.testing.assert_close(out, full_out[:, rows], **tol)
            torch.testing.assert_close(dq, full_dq[:, rows], **tol)
            summed = [a + b for a, b in zip(summed, dkv)]
    for a, b in zip(summed, full_dkv):
        torch.testing.assert_close(a, b, **tol)
