"""Kimi Delta Attention's kernels (glm53/kernels/kda/): the recurrent reference (the definition), the chunked
reference and the fast blocked kernel, forward and every gradient, in one place.

- reference forms: recurrent vs chunked, with and without an initial state, the bounded and the softplus gate,
  awkward lengths; one recurrent step by hand; state continuity; transformers' recurrent loop; a property test.
- fast kernel vs the recurrent reference: every gradient, bf16 against fp32, large decays staying finite, the
  decay-product paths; several blocks of chunks (kda/fast.py) and the working-set bound the blocking exists for;
  q, k of small norm (l2norm's epsilon) and an empty sequence with a state to carry.
- packed documents (`cu_seqlens`): the fast kernel equals each document run alone, on documents of length 1 and
  2, one short of a chunk, longer than a chunk, and two rows whose starts are boundaries.
The decay layouts and the state passing have their own files (test_kda_decay.py, test_kda_state_passing.py), as
the kernels do. Tolerances: tests/helpers/kernel_checks.py (FP32_TOL, BF16_TOL).

Legend: B batch, T time, H heads, K key width, V value width, C chunk length.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers.models.glm5_next.modeling_glm5_next as hf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.kernels.kda import chunk as kda_mod
from glm53.kernels.kda import decay as kda_decay
from glm53.kernels.kda import fast, kda_chunk, kda_chunk_reference, kda_recurrent_reference, l2norm
from tests.helpers.kernel_checks import (
    BF16_TOL,
    FP32_TOL,
    LAYOUTS,
    assert_all_close,
    chunks_per_block,
    cu_for,
    grads,
    kda_inputs,
    packed_kda_inputs,
)


@pytest.mark.parametrize("gate", ["weak", "bounded", "softplus-large"])
@pytest.mark.parametrize("chunks", [1, 3], ids=["1-chunk-blocks", "3-chunk-blocks"])
def test_kda_many_blocks_match_recurrent(chunks, gate, monkeypatch):
    """T = 150 in chunks of 32: 5 blocks of 1 chunk, or 2 blocks (the last one partial and padded); every
    gradient crosses block boundaries through the saved block-start states ("weak": decays of at most -0.1 per
    step, so the state carried over a chunk is large; softplus-large: the recompute path)."""
    B, T, H, K, V = 2, 150, 2, 16, 12
    chunks_per_block(monkeypatch, chunks, B, H, K, V)
    assert fast.n_blocks(B, T, H, K, V) == -(-5 // chunks)
    xs = kda_inputs(B, T, H, K, V, "bounded" if gate == "weak" else gate)
    if gate == "weak":
        xs[3] = (xs[3].detach() * 0.02).requires_grad_()
    ref = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    got = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert_all_close(got, ref, FP32_TOL, ["o", "final_state"])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta", "dS0"])


def test_kda_many_blocks_packed_match_per_document_reference(monkeypatch):
    """Documents that start, span and end inside different blocks (2 chunks of 32 per block)."""
    B, T, H, K, V = 1, 200, 2, 8, 6
    chunks_per_block(monkeypatch, 2, B, H, K, V)
    xs = packed_kda_inputs(B, T, "weak")
    cu = cu_for([5, 90, 1, 70, 34])
    ref, _ = kda_recurrent_reference(*xs, cu_seqlens=cu)
    got, _ = kda_chunk(*xs, cu_seqlens=cu)
    assert_all_close((got,), (ref,), FP32_TOL, ["o"])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta"])


def test_kda_steep_decay_in_the_last_block_only_takes_the_recompute_path(monkeypatch):
    """Bounded decays in the first blocks, softplus-large ones only in the last (partial) block: the backward must
    check every block for the rebased factors' range, not only the first, and fall back (returns None)."""
    B, T, H, K, V = 1, 150, 2, 8, 6
    chunks_per_block(monkeypatch, 2, B, H, K, V)  # blocks of 64 tokens: [0, 64), [64, 128), [128, 150)
    xs = kda_inputs(B, T, H, K, V, "bounded", dtype=torch.float32)
    steep = kda_inputs(B, T, H, K, V, "softplus-large", dtype=torch.float32)[3]
    g = torch.cat([xs[3][:, :128], steep[:, 128:]], dim=1).detach().requires_grad_()
    xs[3] = g
    q, k, v, _, beta, S0 = (x.detach() for x in xs)
    do, dS = torch.randn(B, T, H, V, dtype=q.dtype), torch.randn(B, H, K, V, dtype=q.dtype)
    _, _, boundaries = fast.kda_chunk_core(q * K**-0.5, k, v, g.detach(), beta, S0)
    assert fast.kda_chunk_backward(q * K**-0.5, k, v, g.detach(), beta, do, dS, boundaries) is None
    ref = kda_recurrent_reference(*xs[:5], initial_state=xs[5], output_final_state=True)
    got = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert_all_close(got, ref, FP32_TOL, ["o", "final_state"])
    assert_all_close(grads(got, xs), grads(ref, xs), FP32_TOL, ["dq", "dk", "dv", "dg", "dbeta", "dS0"])


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors ops create inside the block that are alive at once (peak), and the largest one. A
    storage counts until the last tensor on it is gone; tensors made outside (the inputs, `outside`) and their views
    are not counted."""

    def __init__(self, *outside: torch.Tensor):
        super().__init__()
        self.outside = {t.untyped_storage().data_ptr() for t in outside}

    def __enter__(self):
        self.refs, self.sizes, self.now, self.peak, self.largest = {}, {}, 0, 0, 0
        return super().__enter__()

    def _release(self, refs, key):
        refs[key] -= 1
        if refs[key] == 0 and refs is self.refs:
            del refs[key]
            self.now -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key in self.outside:
                    continue
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.now += self.sizes[key]
                    self.peak, self.largest = max(self.peak, self.now), max(self.largest, self.sizes[key])
                self.refs[key] += 1
                weakref.finalize(t, self._release, self.refs, key)
        return out


def test_kda_working_set_is_a_few_token_sized_tensors(monkeypatch):
    """Forward and backward (the op's bodies: a dispatch mode sees the custom op as one call) at K = V = 128 > C,
    where one state per chunk ([T/C, K, V], 4 token-sized tensors) would dominate: nothing that large is ever
    made, and at most 13 token-sized tensors are alive at once (per-chunk states, transitions and their
    gradients for the whole sequence took ~75)."""
    B, T, H, K, V = 1, 1024, 2, 128, 128
    chunks_per_block(monkeypatch, 4, B, H, K, V)  # as at the released widths: the block-start states are 1/4
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, do = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, V, generator=gen)
    g, beta = -5 * torch.rand(B, T, H, K, generator=gen), torch.rand(B, T, H, generator=gen)
    S0, dS = torch.randn(B, H, K, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    token_bytes = B * T * H * K * 4
    live = LiveBytes(q, k, v, do, g, beta, S0, dS)
    with live:
        o, S, boundaries = fast.kda_chunk_core(q, k, v, g, beta, S0)
    live.outside.add(boundaries.untyped_storage().data_ptr())  # the forward's output, counted there
    assert boundaries.shape == (B, H, fast.n_blocks(B, T, H, K, V), K, V) == (B, H, 8, K, V)
    forward_peak = live.peak
    with live:
        grads = fast.kda_chunk_backward(q, k, v, g, beta, do, dS, boundaries)
    assert grads is not None  # the hand-written backward ran (bounded gate)
    assert live.largest <= token_bytes
    assert forward_peak <= 8 * token_bytes and live.peak <= 13 * token_bytes


# ---------------------------------------------------------------------- entry points on small norms and empty sequences
def test_l2norm_matches_transformers_on_small_norms():
    """fla's form, eps inside the root: x / sqrt(|x|^2 + eps). At |x| ~ 1e-3 (a conv output near zero) eps is
    the size of |x|^2 and the placement changes the result by ~30%."""
    x = torch.randn(3, 5, 16, dtype=torch.float64) * torch.logspace(-5, 0, 5, dtype=torch.float64)[:, None]
    torch.testing.assert_close(l2norm(x, 1e-6), hf.l2norm(x, dim=-1, eps=1e-6), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent_reference], ids=["fast", "reference"])
def test_empty_sequence_returns_the_initial_state(fn):
    B, H, K, V = 2, 3, 8, 4
    q = k = torch.zeros(B, 0, H, K)
    S0 = torch.randn(B, H, K, V)
    o, S = fn(
        q,
        k,
        torch.zeros(B, 0, H, V),
        torch.zeros(B, 0, H, K),
        torch.zeros(B, 0, H),
        initial_state=S0,
        output_final_state=True,
    )
    assert o.shape == (B, 0, H, V)
    torch.testing.assert_close(S, S0, rtol=0, atol=0)


# --------------------------------------------------------------- reference forms: recurrent (the definition) vs chunked
def kda_layer_inputs(B, T, H, K, V, gate: str, with_state: bool, seed: int = 0):
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


def kda_grads(fn, inputs, **kwargs):
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
    inputs = kda_layer_inputs(B, T, H, K, V, gate, with_state)
    o_ref, S_ref, g_ref = kda_grads(kda_recurrent_reference, inputs)
    o, S, g = kda_grads(kda_chunk_reference, inputs, chunk_size=C)
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
    q, k, v, g, beta, S0 = kda_layer_inputs(1, 1, 1, 4, 3, "bounded", True)
    o, S = run_kda(kda_recurrent_reference, (q, k, v, g, beta, S0))
    decayed = S0[0, 0] * g[0, 0, 0].exp()[:, None]  # [K, V]
    u = beta[0, 0, 0] * (v[0, 0, 0] - decayed.T @ k[0, 0, 0])
    S_hand = decayed + torch.outer(k[0, 0, 0], u)
    torch.testing.assert_close(S[0, 0], S_hand)
    torch.testing.assert_close(o[0, 0, 0], S_hand.T @ q[0, 0, 0] * 4**-0.5)


def test_kda_state_continuity():
    """Running [a; b] equals running a, then b from a's final state (both implementations)."""
    q, k, v, g, beta, _ = kda_layer_inputs(2, 30, 2, 8, 8, "softplus", False)
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

    q, k, v, g, beta, S0 = kda_layer_inputs(2, 67, 2, 8, 8, "bounded", with_state)
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
    inputs = kda_layer_inputs(B, T, H, K, V, gate, with_state, seed)
    o_ref, S_ref = run_kda(kda_recurrent_reference, inputs)
    o, S = run_kda(kda_chunk_reference, inputs, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-5)


def test_kda_rejects_bad_state_shape():
    q, k, v, g, beta, _ = kda_layer_inputs(1, 3, 2, 4, 4, "bounded", False)
    for fn in (kda_recurrent_reference, kda_chunk_reference):
        with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 4, 3\), expected \(1, 2, 4, 4\)"):
            fn(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 3))


# ----------------------------------------------------------------------- fast chunked kernel vs the recurrent reference
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


# ---------------------------------------------------------------------------------------- packed documents (cu_seqlens)
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
