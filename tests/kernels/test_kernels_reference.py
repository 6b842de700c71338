"""Reference ops in glm53/kernels checked against each other, forward and every gradient.

KDA: recurrent (the definition) vs chunked, with and without initial state, both gate kinds, awkward lengths.
causal_conv1d: tap loop vs grouped F.conv1d, state continuity. Sparse attention: top-k >= T equals dense causal
attention. Sinkhorn: converges to doubly stochastic and matches transformers' inline loop.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.kernels.conv import causal_conv1d, causal_conv1d_reference
from glm53.kernels.kda import kda_chunk_reference, kda_recurrent_reference, l2norm
from glm53.kernels.sinkhorn import sinkhorn_reference
from glm53.kernels.sparse_attention import sparse_attention_reference


# ----------------------------------------------------------------------------------------------------- KDA
def kda_inputs(B, T, H, K, V, gate: str, with_state: bool, seed: int = 0):
    """Random KDA inputs as the layer produces them: unit-norm q, k; log-space decays g <= 0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = l2norm(rand(B, T, H, K))
    k = l2norm(rand(B, T, H, K))
    v = rand(B, T, H, V)
    raw = rand(B, T, H, K)
    if gate == "bounded":
        g = -5.0 * torch.sigmoid(raw)  # the released lower-bounded gate: g in (-5, 0)
    elif gate == "softplus":
        rate = torch.exp(rand(H) * 0.5 + 1.0)[:, None]  # exp(A_log), up to ~10
        g = -rate * F.softplus(raw * 2)  # unbounded decays, some far below -5
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(rand(B, T, H))
    state = rand(B, H, K, V) if with_state else None
    return q, k, v, g, beta, state


def run_kda(fn, inputs, **kwargs):
    q, k, v, g, beta, state = inputs
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, **kwargs)


def grads(fn, inputs, **kwargs):
    """Output, final state and the gradients of a fixed random functional wrt every (present) input."""
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
    o, S = run_kda(fn, leaves, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()
    present = [x for x in leaves if x is not None]
    return o.detach(), S.detach(), torch.autograd.grad(loss, present)


KDA_CASES = [
    # B, T, H, K, V, chunk
    (1, 1, 1, 4, 4, 8),
    (2, 8, 2, 8, 4, 8),
    (2, 37, 2, 8, 6, 16),
    (1, 70, 3, 16, 8, 64),
]


@pytest.mark.parametrize("with_state", [False, True], ids=["nostate", "state"])
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("case", KDA_CASES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}-C{c}" for b, t, h, k, v, c in KDA_CASES])
def test_kda_recurrent_vs_chunk(case, gate, with_state):
    B, T, H, K, V, C = case
    inputs = kda_inputs(B, T, H, K, V, gate, with_state)
    o_ref, S_ref, g_ref = grads(kda_recurrent_reference, inputs)
    o, S, g = grads(kda_chunk_reference, inputs, chunk_size=C)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-5)
    names = ["q", "k", "v", "g", "beta", "initial_state"][: len(g_ref)]
    for name, a, b in zip(names, g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad of {n}: {m}")
    # every input really receives a gradient (except g at T=1 from a zero state: it decays nothing)
    for name, grad in zip(names, g_ref):
        if not (name == "g" and T == 1 and not with_state):
            assert grad.abs().max() > 0, name


def test_kda_recurrent_one_step_by_hand():
    """T=1 from an initial state, written out: S' = e^g S + k beta (v - (e^g S)^T k)^T, o = S'^T q K^-0.5."""
    q, k, v, g, beta, S0 = kda_inputs(1, 1, 1, 4, 3, "bounded", True)
    o, S = run_kda(kda_recurrent_reference, (q, k, v, g, beta, S0))
    decayed = S0[0, 0] * g[0, 0, 0].exp()[:, None]  # [K, V]
    u = beta[0, 0, 0] * (v[0, 0, 0] - decayed.T @ k[0, 0, 0])
    S_hand = decayed + torch.outer(k[0, 0, 0], u)
    torch.testing.assert_close(S[0, 0], S_hand)
    torch.testing.assert_close(o[0, 0, 0], S_hand.T @ q[0, 0, 0] * 4**-0.5)


def test_kda_state_continuity():
    """Running [a; b] equals running a, then b from a's final state (both implementations)."""
    q, k, v, g, beta, _ = kda_inputs(2, 30, 2, 8, 8, "softplus", False)
    for fn in (kda_recurrent_reference, kda_chunk_reference):
        full, S_full = fn(q, k, v, g, beta, output_final_state=True)
        a, S_a = fn(q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], output_final_state=True)
        b, S_b = fn(
            q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], initial_state=S_a, output_final_state=True
        )
        torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(S_b, S_full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_state", [False, True], ids=["nostate", "state"])
def test_kda_matches_transformers(with_state):
    """Both references against transformers' recurrent and chunked KDA (chunk 64, T not a multiple)."""
    from transformers.models.glm5_next import modeling_glm5_next as hf

    q, k, v, g, beta, S0 = kda_inputs(2, 67, 2, 8, 8, "bounded", with_state)
    o_hf, S_hf = hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True)
    o_hf_rec, _ = hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True)
    for fn in (kda_recurrent_reference, kda_chunk_reference):
        o, S = run_kda(fn, (q, k, v, g, beta, S0))
        torch.testing.assert_close(o, o_hf, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(o, o_hf_rec, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(S, S_hf, rtol=1e-4, atol=1e-5)


@settings(deadline=None, max_examples=12, derandomize=True)
@given(
    B=st.integers(1, 2),
    T=st.integers(1, 20),
    H=st.integers(1, 2),
    K=st.integers(1, 6),
    V=st.integers(1, 5),
    chunk=st.integers(1, 9),
    gate=st.sampled_from(["bounded", "softplus"]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kda_recurrent_equals_chunk_property(B, T, H, K, V, chunk, gate, with_state, seed):
    inputs = kda_inputs(B, T, H, K, V, gate, with_state, seed)
    o_ref, S_ref = run_kda(kda_recurrent_reference, inputs)
    o, S = run_kda(kda_chunk_reference, inputs, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-5)


def test_kda_rejects_bad_state_shape():
    q, k, v, g, beta, _ = kda_inputs(1, 3, 2, 4, 4, "bounded", False)
    for fn in (kda_recurrent_reference, kda_chunk_reference):
        with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 4, 3\), expected \(1, 2, 4, 4\)"):
            fn(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 3))


# ---------------------------------------------------------------------------------------------------- conv
CONV_CASES = [(1, 1, 3, 4), (2, 9, 5, 4), (2, 20, 6, 3), (1, 7, 4, 2)]  # B, T, D, W
CONV_IDS = [f"B{b}-T{t}-D{d}-W{w}" for b, t, d, w in CONV_CASES]


def conv_by_hand(x, weight, state=None):
    """y[b, t, d] = sum_w weight[d, w] x[b, t - (W-1) + w, d], with x before 0 read from the state (or 0)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    history = torch.zeros(B, D, W - 1) if state is None else state
    full = torch.cat([history.transpose(1, 2), x], dim=1)  # [B, W-1+T, D]
    y = torch.zeros(B, T, D)
    for t in range(T):
        for w in range(W):
            y[:, t] += weight[:, w] * full[:, t + w]
    return y


@pytest.mark.parametrize("with_state", [False, True], ids=["nostate", "state"])
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_causal_conv1d_reference_vs_eager(case, with_state):
    B, T, D, W = case
    x, weight = torch.randn(B, T, D), torch.randn(D, W)
    state = torch.randn(B, D, W - 1) if with_state else None
    leaves = [t.clone().requires_grad_(True) for t in (x, weight) + ((state,) if with_state else ())]
    results = []
    for fn in (causal_conv1d_reference, causal_conv1d):
        ins = [t.detach().clone().requires_grad_(True) for t in leaves]
        y, final = fn(ins[0], ins[1], initial_state=ins[2] if with_state else None, output_final_state=True)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
        results.append((y.detach(), final.detach(), torch.autograd.grad((y * cot).sum(), ins)))
    (y_ref, s_ref, g_ref), (y, s, g) = results
    torch.testing.assert_close(y_ref, conv_by_hand(x, weight, state))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(s, s_ref)
    full = torch.cat([torch.zeros(B, D, W - 1) if state is None else state, x.transpose(1, 2)], dim=-1)
    torch.testing.assert_close(s_ref, full[:, :, -(W - 1) :])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fn", [causal_conv1d_reference, causal_conv1d], ids=["reference", "fast"])
def test_causal_conv1d_state_continuity(fn):
    """conv over [a; b] == conv(a), then conv(b) from a's final state; also for a shorter than the kernel."""
    x, weight = torch.randn(2, 15, 5), torch.randn(5, 4)
    full, _ = fn(x, weight)
    for split in (1, 2, 9):
        ya, state = fn(x[:, :split], weight, output_final_state=True)
        yb, _ = fn(x[:, split:], weight, initial_state=state)
        torch.testing.assert_close(torch.cat([ya, yb], dim=1), full)


def test_causal_conv1d_matches_transformers():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    x, weight = torch.randn(2, 11, 6), torch.randn(6, 4)
    expected = hf.causal_conv1d_fn(x.transpose(1, 2), weight).transpose(1, 2)
    for fn in (causal_conv1d_reference, causal_conv1d):
        torch.testing.assert_close(fn(x, weight)[0], expected)


def test_causal_conv1d_rejects_bad_shapes():
    x = torch.randn(2, 5, 6)
    for fn in (causal_conv1d_reference, causal_conv1d):
        with pytest.raises(ValueError, match=r"conv weight has shape \(5, 4\), expected \(6, W\)"):
            fn(x, torch.randn(5, 4))
        with pytest.raises(ValueError, match=r"conv state has shape \(2, 6, 2\), expected \(2, 6, 3\)"):
            fn(x, torch.randn(6, 4), initial_state=torch.randn(2, 6, 2))


# --------------------------------------------------------------------------------------- sparse attention
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


# ---------------------------------------------------------------------------------------------- sinkhorn
@pytest.mark.parametrize("n", [1, 2, 4, 6], ids=lambda n: f"N{n}")
def test_sinkhorn_converges_to_doubly_stochastic(n):
    x = torch.softmax(torch.randn(3, 5, n, n) * 3, dim=-1) + 1e-6
    out = sinkhorn_reference(x, 200, 1e-6)
    torch.testing.assert_close(out.sum(-1), torch.ones(3, 5, n), rtol=0, atol=1e-4)
    torch.testing.assert_close(out.sum(-2), torch.ones(3, 5, n), rtol=0, atol=1e-4)
    # a doubly stochastic scaling of x: out = diag(r) x diag(c), so out / x has rank one
    ratio = out / x
    torch.testing.assert_close(ratio * ratio[..., :1, :1], ratio[..., :, :1] * ratio[..., :1, :], rtol=1e-4, atol=0)


@pytest.mark.parametrize("iters", [1, 2, 20], ids=lambda i: f"iters{i}")
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"N{n}")
def test_sinkhorn_matches_transformers(n, iters):
    """With fn = 0 the comb logits are the base, so transformers' module returns sinkhorn(softmax(base) + eps)."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next import modeling_glm5_next as hf

    hc = hf.Glm5NextTextHyperConnection(Glm5NextTextConfig(hidden_size=8, hc_mult=n, hc_sinkhorn_iters=iters))
    logits = torch.randn(n, n) * 2
    with torch.no_grad():
        hc.fn.zero_()
        hc.scale.fill_(1.0)
        hc.base.copy_(torch.cat([torch.zeros(2 * n), logits.flatten()]))
        _, comb, _ = hc(torch.randn(1, 1, n, 8))
    ours = sinkhorn_reference(torch.softmax(logits, -1) + hc.hc_eps, iters, hc.hc_eps)
    torch.testing.assert_close(ours, comb[0, 0], rtol=1e-6, atol=1e-7)
    if iters == 1:
        # one iteration is a single column normalisation: columns sum to 1, rows in general do not
        torch.testing.assert_close(ours.sum(-2), torch.ones(n), rtol=0, atol=1e-5)
        assert not torch.allclose(ours.sum(-1), torch.ones(n), atol=1e-3)
    assert math.isclose(float(ours.sum()), n, rel_tol=1e-4)
