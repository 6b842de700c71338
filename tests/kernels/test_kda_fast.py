"""The fast KDA kernel over several blocks of chunks (kda/fast.py): parity with the recurrent reference when a
sequence spans many blocks, and the working-set bound the blocking exists for.

Legend: B batch, T time, H heads, K key width, V value width, C chunk length.

KDA kernel entry points on inputs the parity grid does not use: q, k of small norm (where l2norm's epsilon
placement shows) and an empty sequence with a state to carry.

Legend: B batch, T time, H heads, K key width, V value width.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers.models.glm5_next.modeling_glm5_next as hf
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.kernels.kda import fast, kda_chunk, kda_recurrent_reference, l2norm
from tests.kernels.test_kernels_fast import FP32_TOL, assert_all_close, grads, kda_inputs
from tests.kernels.test_kernels_packed import cu_for, packed_kda_inputs


def chunks_per_block(monkeypatch, chunks: int, B: int, H: int, K: int, V: int) -> None:
    monkeypatch.setattr(fast, "STATE_BUDGET", chunks * B * H * K * V)


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
