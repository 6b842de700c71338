"""Top-k sparse attention (glm53/kernels/sparse_attention.py, sparse_static.py): the per-head kernel and the
absorbed (MQA over the latent) kernel, their references, the span-reading fast forms and the static forms, forward
and every gradient.

- the per-head chunk plan (`_per_head_chunks`): which query chunks run masked-dense, which merge, over which key
  span (chunks of 4 queries, GATHER_BUDGET 1, MIN_QUERY_CHUNK 4; a chunk is dense when its span is <= 4 * J = 12).
- packed documents at their edges: a slot on the next document's first token or the previous one's last token is
  empty, one on the query's own first or last token is read (the `<= end` mutant of issue #34). Inputs fp32
  N(0, 1): a score's fp32 error is at most K * eps * sum|q_i k_i| (<= 4 * 1.2e-7 * 16), carried through a softmax
  over <= 4 slots and |v| <= 4: atol = 3.1e-5, far below what one wrong token changes (O(0.1)).
- fewer queries than keys (context parallelism): a slice of the queries gives that slice of the output, and the
  slices' key/value gradients sum to the full ones; both backends, both kernels, dense-span and gather paths.
- reference by hand: top-k >= T selecting everything is dense causal attention; a subset by hand; empty rows 0.
- fast forms vs the dense reference on awkward shapes and chunkings (FP32_TOL, tests/helpers/kernel_checks.py).
- bf16 within the rounding of the exact answer: inputs rounded to bf16 once, the fp32 reference on the same values
  is exact up to fp32 noise; a kernel computing in fp32 and rounding once is within about one bf16 rounding of it,
  one that skips the upcast (bf16 scores, softmax or accumulation) is several roundings off and fails.
- packed documents (`cu_seqlens`): equal to each document run alone.

Legend (glm53/model/__init__.py): B batch, T queries, S keys, H heads, D q/k width, E value width, Z latent
width, J selected slots per query.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels import kernel, use_backend
from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)
from glm53.kernels.sparse_static import sparse_attention_static, sparse_mqa_attention_static
from tests.helpers.kernel_checks import (
    BF16_TOL,
    FP32_TOL,
    LAYOUTS,
    assert_all_close,
    cu_for,
    grads,
    sparse_inputs,
)

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


# ----------------------------------------------------------------------- reference by hand: all selected = dense causal
@pytest.mark.parametrize("extra_slots", [0, 5], ids=["topk-eq-T", "topk-gt-T"])
@pytest.mark.parametrize("T", [1, 9, 17], ids=lambda t: f"T{t}")
def test_sparse_attention_all_selected_is_dense_causal(T, extra_slots):
    B, H, D, E = 2, 3, 8, 5
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, H, E)
    scale = D**-0.5
    # every causal key, in shuffled order, then -1 padding slots
    positions = torch.arange(T)
    topk = torch.where(positions[None, :] <= positions[:, None], positions[None, :], -1)  # [T, T]
    topk = topk[:, torch.randperm(T)]
    topk = torch.cat([topk, torch.full((T, extra_slots), -1)], dim=-1).expand(B, -1, -1)
    out = sparse_attention_reference(q, k, v, topk, scale)
    dense = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    ).transpose(1, 2)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


def test_sparse_attention_subset_by_hand():
    """A random subset per query equals softmax over exactly those keys, computed one row at a time."""
    B, T, H, D, E = 1, 6, 2, 4, 3
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, H, E)
    chosen = [[0], [1, 0], [2], [0, 3], [1, 2, 4], [5, 0, 3]]
    topk = torch.tensor([[row + [-1] * (3 - len(row)) for row in chosen]])
    out = sparse_attention_reference(q, k, v, topk, 0.7)
    for t, keys in enumerate(chosen):
        for h in range(H):
            p = torch.softmax(torch.stack([q[0, t, h] @ k[0, s, h] * 0.7 for s in keys]), dim=0)
            torch.testing.assert_close(out[0, t, h], sum(p[i] * v[0, s, h] for i, s in enumerate(keys)))


def test_sparse_attention_empty_rows_are_zero():
    B, T, H = 2, 5, 2
    q, k, v = torch.randn(B, T, H, 4), torch.randn(B, T, H, 4), torch.randn(B, T, H, 3)
    topk = torch.arange(T).expand(B, T, T).clone()
    topk[0, 2] = -1
    topk[1] = -1
    out = sparse_attention_reference(q, k, v, topk, 0.5)
    assert torch.equal(out[0, 2], torch.zeros(H, 3))
    assert torch.equal(out[1], torch.zeros(T, H, 3))
    assert torch.isfinite(out).all() and out[0, 3].abs().sum() > 0


# ------------------------------------------------------------- fast forms vs the dense reference, forward and gradients
SPARSE_SHAPES = [(2, 37, 37, 3, 8, 5, 7), (1, 1, 1, 2, 4, 4, 3), (2, 20, 20, 2, 4, 6, 40), (1, 50, 80, 2, 8, 8, 9)]


# (budget, fewest queries per chunk): "min-chunk" is the released widths' regime, where one query alone exceeds the
# budget (the old code's chunk of 1 query); "small-chunks" crosses many chunk boundaries
CHUNKINGS = {"min-chunk": (64, 16), "small-chunks": (64, 3), "one-chunk": (1 << 22, 16)}


# "static": the backend planned from shapes alone (kernels/sparse_static.py), every chunk over all S keys
@pytest.mark.parametrize("form", [sparse_attention, sparse_attention_static], ids=["spans", "static"])
@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
@pytest.mark.parametrize("chunking", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize(
    "shape", SPARSE_SHAPES, ids=[f"B{s[0]}-T{s[1]}-S{s[2]}-H{s[3]}-J{s[6]}" for s in SPARSE_SHAPES]
)
def test_sparse_attention_matches_dense_reference(shape, chunking, span_ratio, form, monkeypatch):
    monkeypatch.setattr(sa_mod, "GATHER_BUDGET", chunking[0])
    monkeypatch.setattr(sa_mod, "MIN_QUERY_CHUNK", chunking[1])
    monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)  # force one chunk path
    monkeypatch.setattr(sa_mod, "DENSE_BUDGET", chunking[0])  # small: dense chunks mostly unmerged; large: merged
    (q, k, v), idx = sparse_inputs(*shape)
    ref = sparse_attention_reference(q, k, v, idx, 0.3)
    got = form(q, k, v, idx, 0.3)
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert (got[0, 0] == 0).all()  # all slots -1 -> zero output
    assert_all_close(grads(got, [q, k, v]), grads(ref, [q, k, v]), FP32_TOL, ["dq", "dk", "dv"])


def test_sparse_attention_bf16():
    (q, k, v), idx = sparse_inputs(2, 30, 30, 2, 8, 8, 6, dtype=torch.float32)
    ref = sparse_attention_reference(*(x.detach().to(torch.bfloat16).float() for x in (q, k, v)), idx, 0.35)
    got = sparse_attention(*(x.detach().to(torch.bfloat16) for x in (q, k, v)), idx, 0.35)
    assert got.dtype == torch.bfloat16
    assert_all_close((got,), (ref,), BF16_TOL, ["o"])


@pytest.mark.parametrize("form", [sparse_mqa_attention, sparse_mqa_attention_static], ids=["spans", "static"])
@pytest.mark.parametrize("span_ratio", [-1, 1 << 30], ids=["gather", "masked-dense"])
@pytest.mark.parametrize("chunking", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize(
    "shape", SPARSE_SHAPES, ids=[f"B{s[0]}-T{s[1]}-S{s[2]}-H{s[3]}-J{s[6]}" for s in SPARSE_SHAPES]
)
def test_sparse_mqa_attention_matches_dense_reference(shape, chunking, span_ratio, form, monkeypatch):
    monkeypatch.setattr(sa_mod, "GATHER_BUDGET", chunking[0])
    monkeypatch.setattr(sa_mod, "MIN_QUERY_CHUNK", chunking[1])
    monkeypatch.setattr(sa_mod, "DENSE_SPAN_RATIO", span_ratio)  # force one chunk path
    B, T, S, H, D, _, J = shape
    (q, k, _), idx = sparse_inputs(B, T, S, H, D, D, J)
    kv = k[:, :, 0].detach().requires_grad_()  # [B, S, C]: one latent shared by all heads
    ref = sparse_mqa_attention_reference(q, kv, idx, 0.3)
    got = form(q, kv, idx, 0.3)
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert (got[0, 0] == 0).all()
    assert_all_close(grads(got, [q, kv]), grads(ref, [q, kv]), FP32_TOL, ["dq", "dkv"])


# ------------------------------------------------------------------------- bf16 within the rounding of the exact answer
MAX_ROUNDINGS = 1.5  # the largest error over the largest rounding of the reference (ties may round the other way)


MEAN_ROUNDINGS = 1.25  # the mean error over the mean rounding


def assert_within_bf16_rounding(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.bfloat16, what
    rounding = (ref.to(torch.bfloat16).float() - ref).abs()
    err = (got.float() - ref).abs()
    assert rounding.max() > 0, what
    assert err.max() <= MAX_ROUNDINGS * rounding.max(), (
        f"{what}: max error {err.max():.3e} vs rounding {rounding.max():.3e}"
    )
    assert err.mean() <= MEAN_ROUNDINGS * rounding.mean(), (
        f"{what}: mean error {err.mean():.3e} vs rounding {rounding.mean():.3e}"
    )


def bf16_leaves(*xs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(bf16 leaves, fp32 leaves holding the same values) for the kernel and the reference."""
    low = [x.detach().to(torch.bfloat16).requires_grad_() for x in xs]
    return low, [x.detach().float().requires_grad_() for x in low]


def backward(out: torch.Tensor, inputs: list[torch.Tensor], cot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, cot.to(out.dtype))


CASES = {"B2-T40-S40-H4-J9": (2, 40, 40, 4, 32, 32, 9), "B1-T33-S50-H2-J40": (1, 33, 50, 2, 64, 16, 40)}


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_mqa_attention_bf16_within_rounding(case):
    B, T, S, H, D, _, J = CASES[case]
    (q, k, _), idx = sparse_inputs(B, T, S, H, D, D, J, dtype=torch.float32)
    (q16, kv16), (q32, kv32) = bf16_leaves(3 * q, k[:, :, 0])  # [B, T, H, C], [B, S, C]: one shared latent
    scale = D**-0.5
    got = sparse_mqa_attention(q16, kv16, idx, scale)
    ref = sparse_mqa_attention_reference(q32, kv32, idx, scale)
    assert_within_bf16_rounding(got, ref.detach(), "o")
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    for name, g, r in zip(("dq", "dkv"), backward(got, [q16, kv16], cot), backward(ref, [q32, kv32], cot)):
        assert_within_bf16_rounding(g, r, name)


@pytest.mark.parametrize("span_ratio", [-1, None], ids=["gather", "default-ratio"])
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_bf16_within_rounding(case, span_ratio, monkeypatch):
    if span_ratio is not None:  # the default ratio sends every chunk of these short sequences dense
        monkeypatch.setattr(sa_mod, "PER_HEAD_DENSE_SPAN_RATIO", span_ratio)
    B, T, S, H, D, E, J = CASES[case]
    (q, k, v), idx = sparse_inputs(B, T, S, H, D, E, J, dtype=torch.float32)
    (q16, k16, v16), (q32, k32, v32) = bf16_leaves(3 * q, k, v)
    scale = D**-0.5
    got = sparse_attention(q16, k16, v16, idx, scale)
    ref = sparse_attention_reference(q32, k32, v32, idx, scale)
    assert_within_bf16_rounding(got, ref.detach(), "o")
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    grads = zip(("dq", "dk", "dv"), backward(got, [q16, k16, v16], cot), backward(ref, [q32, k32, v32], cot))
    for name, g, r in grads:
        assert_within_bf16_rounding(g, r, name)


# ---------------------------------------------------------------------------------------- packed documents (cu_seqlens)
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
