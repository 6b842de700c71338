"""Every fast (eager) kernel equals its reference: forward and all gradients, on awkward shapes.

fp32 comparisons are tight (the references compute in fp32, so fp64 inputs compare at fp32 rounding); bf16 is
checked against the fp32 reference with the documented looser tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels import indexer_scores as idx_mod
from glm53.kernels import sparse_attention as sa_mod
from glm53.kernels.hc_collapse import hc_collapse, hc_collapse_reference
from glm53.kernels.indexer_scores import indexer_scores, indexer_scores_reference
from glm53.kernels.kda import chunk as kda_mod
from glm53.kernels.kda import decay as kda_decay
from glm53.kernels.kda import kda_chunk, kda_recurrent_reference
from glm53.kernels.moe import (
    moe_experts_few_token,
    moe_experts_grouped,
    moe_experts_padded,
    moe_experts_reference,
)
from glm53.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_mqa_attention,
    sparse_mqa_attention_reference,
)
from glm53.kernels.sparse_static import sparse_attention_static, sparse_mqa_attention_static

FP32_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # bf16 inputs/outputs, fp32 inside: the output rounding dominates


def grads(out, inputs, seed=1):
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cot = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype) for o in outs)
    return torch.autograd.grad(outs, inputs, cot)


def assert_all_close(got, ref, tol, names):
    for name, a, b in zip(names, got, ref):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(
            a.float(), b.float(), rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


# --------------------------------------------------------------------------------------------------------- KDA
def kda_inputs(B, T, H, K, V, gate, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    # "bounded": transformers' -5 * sigmoid gate; "softplus-large": decays up to -300 per step (softplus gate with
    # a large rate) so a sub-chunk's span overflows exp() and the hierarchical path must be used
    g = -5 * u if gate == "bounded" else -300 * u**3
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    S0 = rnd(B, H, K, V)
    return [x.to(dtype).requires_grad_() for x in (q, k, rnd(B, T, H, V), g, beta, S0)]


KDA_SHAPES = [(2, 1, 2, 8, 8), (1, 5, 2, 16, 8), (2, 70, 3, 16, 12), (1, 130, 2, 32, 16)]


@pytest.mark.parametrize("gate", ["bounded", "softplus-large"])
@pytest.mark.parametrize("shape", KDA_SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in KDA_SHAPES])
def test_kda_chunk_matches_recurrent(shape, gate):
    xs = kda_inputs(*shape, gate)
    ref = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    got = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert_all_close(got, ref, FP32_TOL, ["o", "final_state"])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta", "dS0"])


def test_kda_without_initial_state_and_final_state():
    q, k, v, g, beta, _ = kda_inputs(1, 37, 2, 8, 8, "bounded")
    ref, _ = kda_recurrent_reference(q, k, v, g, beta)
    got, state = kda_chunk(q, k, v, g, beta)
    assert state is None
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert_all_close(grads(got, [q, k, v, g, beta]), grads(ref, [q, k, v, g, beta]), FP32_TOL, "qkvgb")


@pytest.mark.parametrize("gate", ["bounded", "softplus-large"])
def test_kda_decay_products_paths_agree(gate):
    """Sub-chunk rebasing and the hierarchical factorisation give the same products (fp64, tight)."""
    q, k, _, g, _, _ = (x.detach() for x in kda_inputs(1, 64, 2, 16, 16, gate))
    G = g.transpose(1, 2).cumsum(2)  # [B, H, C, K]
    a, b = q.transpose(1, 2), k.transpose(1, 2)
    exact = torch.einsum("bhtc,bhjc,bhtjc->bhtj", a, b, (G[:, :, :, None] - G[:, :, None]).clamp(max=0).exp()).tril()
    torch.testing.assert_close(kda_decay._decayed_products(a, b, G), exact, rtol=1e-10, atol=1e-12)
    assert kda_decay._rebase_is_safe(G) == (gate == "bounded")
    if gate == "bounded":
        kk, qk = kda_decay._rebased_products(kda_decay._rebased_factors(b, a, G))  # rows (k=b, q=a), columns b
        torch.testing.assert_close(qk, exact, rtol=1e-10, atol=1e-12)
        exact_kk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", b, b, (G[:, :, :, None] - G[:, :, None]).clamp(max=0).exp())
        torch.testing.assert_close(kk, exact_kk.tril(-1), rtol=1e-10, atol=1e-12)


def test_kda_large_decay_fp32_stays_finite():
    """fp32 with decays down to -300 per step: finite everywhere and equal to the chunked reference.

    Against the recurrent form both chunked forms (reference and fast, identically) differ by ~2e-4 relative in
    this regime: the intra-chunk system I + diag(beta) A is solved in fp32 (an fla-style WY property, not the
    decay factorisation, which the fp64 tests above pin down), hence the looser recurrent tolerance.
    """
    from glm53.kernels.kda import kda_chunk_reference

    xs = kda_inputs(1, 200, 2, 16, 16, "softplus-large", dtype=torch.float32)
    o, S = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert all(torch.isfinite(t).all() for t in (o, S, *grads((o, S), xs)))
    chunked = kda_chunk_reference(
        *xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=kda_mod.FAST_CHUNK_SIZE
    )  # same chunking: same fp32 WY solve
    assert_all_close((o, S), chunked, FP32_TOL, ["o", "final_state"])
    recurrent = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert_all_close((o, S), recurrent, dict(rtol=1e-3, atol=2e-4), ["o", "final_state"])


def test_kda_bf16_close_to_fp32_reference():
    xs = kda_inputs(1, 70, 2, 16, 16, "bounded", dtype=torch.float32)
    low = [x.detach().to(torch.bfloat16).requires_grad_() for x in xs[:5]]
    ref, _ = kda_recurrent_reference(*[x.detach().to(torch.bfloat16).float() for x in xs[:5]])
    got, _ = kda_chunk(*low)
    assert got.dtype == torch.bfloat16
    assert_all_close((got,), (ref,), BF16_TOL, ["o"])


# -------------------------------------------------------------------------------------------- sparse attention
def sparse_inputs(B, T, S, H, D, E, J, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, S, H, D, generator=gen)
    v = torch.randn(B, S, H, E, generator=gen)
    rows = []
    for _ in range(B * T):  # distinct causal-looking selections with -1 holes, J may exceed S
        perm = torch.randperm(S, generator=gen)[: min(J, S)]
        perm = torch.where(torch.rand(perm.shape, generator=gen) < 0.2, -1, perm)
        rows.append(F.pad(perm, (0, J - perm.numel()), value=-1))
    idx = torch.stack(rows).view(B, T, J)
    idx[0, 0] = -1  # an all-empty (padding) row
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], idx


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


# -------------------------------------------------------------------------------------------------------- MoE
MOE_CASES = {
    "N50-E6-k3-one-idle-expert": (50, 64, 32, 6, 3),
    "N1-E4-k2": (1, 16, 8, 4, 2),
    "N33-E8-k2-unaligned": (33, 12, 6, 8, 2),
}


@pytest.mark.parametrize(
    "fast", [moe_experts_grouped, moe_experts_padded, moe_experts_few_token], ids=["grouped", "padded", "few-token"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_grouped_equals_expert_loop(case, dtype, fast):
    N, H, I, E, k = MOE_CASES[case]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype).requires_grad_()
    idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(N)])  # expert E-1 gets no token
    w = torch.rand(N, k, generator=gen).requires_grad_()
    ref = moe_experts_reference(x, idx, w, gate_up, down, 1.0)
    got = fast(x, idx, w, gate_up, down, 1.0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert_all_close((got,), (ref,), tol, ["out"])
    inputs = [x, w, gate_up, down]
    assert_all_close(grads(got, inputs), grads(ref, inputs), tol, ["dx", "dweight", "dgate_up", "ddown"])


# ---------------------------------------------------------------------------------------------- indexer scores
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


# ---------------------------------------------------------------------------------------------- mHC collapse
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hc_collapse_equals_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    pre = torch.rand(2, 7, 4, generator=gen).requires_grad_()
    streams = torch.randn(2, 7, 4, 16, generator=gen).to(dtype).requires_grad_()
    ref = hc_collapse_reference(pre, streams)
    got = hc_collapse(pre, streams)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert_all_close(
        grads(got, [pre, streams]),
        grads(ref, [pre, streams]),
        FP32_TOL if dtype == torch.float32 else BF16_TOL,
        ["dpre", "dstreams"],
    )


# ------------------------------------------------------------------------------------------------- RMS norms
NORM_SHAPES = [(2, 7, 16), (1, 1, 5), (3, 4, 2, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=["B2-T7-D16", "B1-T1-D5", "B3-T4-H2-D8"])
def test_rms_norm_equals_reference(shape, dtype):
    from glm53.kernels.rms_norm import rms_norm, rms_norm_reference

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    x.data[0, 0].mul_(1e-3)  # a tiny-RMS row: the eps inside the rsqrt matters there
    w = (1 + torch.randn(shape[-1], generator=gen)).requires_grad_()  # the weight stays fp32
    ref, got = rms_norm_reference(x, w, 1e-5), rms_norm(x, w, 1e-5)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # same forward arithmetic
    g_got, g_ref = grads(got, [x, w]), grads(ref, [x, w])
    assert [g.dtype for g in g_got] == [g.dtype for g in g_ref]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL  # both compute in fp32; bf16 rounds the outputs
    assert_all_close(g_got, g_ref, tol, ["dx", "dweight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=["B2-T7-D16", "B1-T1-D5", "B3-T4-H2-D8"])
def test_gated_rms_norm_equals_reference(shape, dtype):
    from glm53.kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    gate = (2 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    w = (1 + torch.randn(shape[-1], generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    ref, got = gated_rms_norm_reference(x, gate, w, 1e-5), gated_rms_norm(x, gate, w, 1e-5)
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    g_got, g_ref = grads(got, [x, gate, w]), grads(ref, [x, gate, w])
    assert [g.dtype for g in g_got] == [dtype] * 3
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL  # both compute in fp32; bf16 rounds the outputs
    assert_all_close(g_got, g_ref, tol, ["dx", "dgate", "dweight"])


# ---------------------------------------------------------------------------------------------- mHC mix
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(2, 7, 4, 16), (1, 1, 3, 5), (3, 5, 1, 8)], ids=["B2-T7-N4-D16", "B1-T1-N3-D5", "B3-T5-N1-D8"]
)
def test_hc_mix_equals_reference(shape, dtype):
    from glm53.kernels.hc_mix import hc_mix, hc_mix_reference

    B, T, N, D = shape
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(B, T, N, D, generator=gen).to(dtype).requires_grad_()
    comb = torch.rand(B, T, N, N, generator=gen).requires_grad_()  # fp32 coefficients, as the module passes them
    post = (2 * torch.rand(B, T, N, generator=gen)).requires_grad_()
    out = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    inputs = [streams, comb, post, out]
    ref, got = hc_mix_reference(*inputs), hc_mix(*inputs)
    assert got.dtype == ref.dtype == dtype and got.shape == (B, T, N, D)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_all_close((got,), (ref,), tol, ["new"])
    g_got, g_ref = grads(got, inputs), grads(ref, inputs)
    assert [g.dtype for g in g_got] == [g.dtype for g in g_ref] == [dtype, torch.float32, torch.float32, dtype]
    assert_all_close(g_got, g_ref, tol, ["dstreams", "dcomb", "dpost", "dout"])


# ------------------------------------------------------------------------------------------ mHC projection
@pytest.mark.parametrize("shape", [(2, 7, 64), (1, 1, 12), (3, 40)], ids=["B2-T7-K64", "B1-T1-K12", "M3-K40"])
def test_hc_project_equals_reference(shape):
    from glm53.kernels.hc_project import hc_project, hc_project_reference

    gen = torch.Generator().manual_seed(0)
    flat = (3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()
    flat.data[0].mul_(1e-4)  # a token with a tiny RMS: the eps inside the rsqrt matters there
    fn = (0.1 * torch.randn(10, shape[-1], generator=gen, dtype=torch.float64)).requires_grad_()
    ref, got = hc_project_reference(flat, fn, 1e-5), hc_project(flat, fn, 1e-5)
    assert got.shape == (*shape[:-1], 10)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads(got, [flat, fn]), grads(ref, [flat, fn]), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------ absorbed (latent, multi-query) attention
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


# ------------------------------------------------------------------------------------------------------ Sinkhorn
@pytest.mark.parametrize("iters", [1, 2, 20], ids=["iters1", "iters2", "iters20"])
def test_sinkhorn_backward_equals_autograd(iters):
    from glm53.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    gen = torch.Generator().manual_seed(0)
    x = (torch.softmax(torch.randn(3, 5, 4, 4, generator=gen, dtype=torch.float64), -1) + 1e-6).requires_grad_()
    ref, got = sinkhorn_reference(x, iters, 1e-6), sinkhorn(x, iters, 1e-6)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(grads(got, [x])[0], grads(ref, [x])[0], rtol=1e-5, atol=1e-6)  # both fp32 inside


def test_clamped_swiglu_backward_equals_autograd():
    from glm53.kernels.moe import _clamped_swiglu_forward, clamped_swiglu

    gen = torch.Generator().manual_seed(0)
    gate, up = (3 * torch.randn(2, 40, 16, generator=gen, dtype=torch.float64)).requires_grad_().unbind(0)
    got, ref = clamped_swiglu(gate, up, 1.5), _clamped_swiglu_forward(gate, up, 1.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(grads(got, [gate, up]), grads(ref, [gate, up]), rtol=1e-12, atol=1e-12)
    assert (gate > 1.5).any() and (up.abs() > 1.5).any(), "both clamps must be exercised"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_packed_clamped_swiglu_equals_autograd(dtype):
    from glm53.kernels.moe import _clamped_swiglu_forward, clamped_swiglu_packed

    gen = torch.Generator().manual_seed(0)
    gate_up = (3 * torch.randn(40, 32, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    got, ref = clamped_swiglu_packed(gate_up, 1.5), _clamped_swiglu_forward(*gate_up.chunk(2, dim=-1), 1.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    (d_got,), (d_ref,) = grads(got, [gate_up]), grads(ref, [gate_up])
    assert d_got.shape == gate_up.shape and d_got.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(d_got, d_ref, **tol)


def test_moe_grouped_bf16_close_to_fp32_loop():
    gen = torch.Generator().manual_seed(0)
    N, H, I, E, k = 40, 64, 32, 6, 2
    x = torch.randn(N, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=gen)
    low = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    ref = moe_experts_reference(low[0].float(), idx, w, low[1].float(), low[2].float(), 1.0)
    got = moe_experts_grouped(low[0], idx, w, low[1], low[2], 1.0)
    assert got.dtype == torch.bfloat16
    assert_all_close((got,), (ref,), BF16_TOL, ["out"])
