"""The decode step's host-scalar mHC coefficients (glm53/generation/decode_host.py) against the tensor formulas.

Legend: B batch, N streams (4). z [B, (2+N)*N]: scale * projected logits + base, as decode._coefficients has them.
Peaked comb logits keep Sinkhorn moving at its last iteration; extreme logits (|z| = 1000) must not overflow the
host exp; the host form is taken only for one or two CPU rows with N = 4, and decode._coefficients gives the same
numbers on either path.
"""

from __future__ import annotations

import pytest
import torch

from glm53.generation import decode as D
from glm53.generation.decode_host import HOST_ROWS, host_coefficients, use_host
from glm53.kernels.sinkhorn import sinkhorn_reference
from tests.helpers.generation import tiny_model

N, EPS, ITERS = 4, 1e-6, 20


def _tensor_coefficients(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HyperConnection.coefficients after the projection, as fp32 tensor ops."""
    gates = torch.sigmoid(z[:, : 2 * N])
    comb = torch.softmax(z[:, 2 * N :].view(-1, N, N), dim=-1) + EPS
    return gates[:, :N] + EPS, 2 * gates[:, N:], sinkhorn_reference(comb, ITERS, EPS)


@pytest.mark.parametrize("B", [1, 2])
def test_host_coefficients_equal_tensor_formulas(B):
    gen = torch.Generator().manual_seed(B)
    z = torch.randn(B, (2 + N) * N, generator=gen) * torch.tensor([2.0] * (2 * N) + [6.0] * (N * N))
    got = host_coefficients(z, N, EPS, ITERS)
    for g, w in zip(got, _tensor_coefficients(z)):
        assert g.shape == w.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7)
    # the row softmax is over each row of the comb logits (a column softmax would differ here)
    col = torch.softmax(z[:, 2 * N :].view(B, N, N), dim=-2) + EPS
    assert (sinkhorn_reference(col, ITERS, EPS) - got[2]).abs().max() > 1e-3


def test_host_coefficients_extreme_logits():
    """|z| = 1000: saturated gates (pre = eps or 1 + eps, post = 0 or 2) and a one-hot softmax, no overflow."""
    z = torch.tensor([[1000.0, -1000.0] * N + [1000.0 if i % (N + 1) == 0 else -1000.0 for i in range(N * N)]])
    pre, post, comb = host_coefficients(z, N, EPS, ITERS)
    want = _tensor_coefficients(z)
    for g, w in zip((pre, post, comb), want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7)
    assert torch.equal(post, torch.tensor([[2.0, 0.0, 2.0, 0.0]]))


def test_host_form_only_for_small_cpu_batches():
    z = torch.zeros(HOST_ROWS, (2 + N) * N)
    assert use_host(z, N)
    assert not use_host(torch.zeros(HOST_ROWS + 1, (2 + N) * N), N)
    assert not use_host(torch.zeros(1, (2 + 3) * 3), 3)
    assert not use_host(torch.zeros(1, (2 + N) * N, device="meta"), N)


def test_tensor_and_host_paths_agree():
    """decode._coefficients on HOST_ROWS + 1 rows (the tensor path: baddbmm Sinkhorn in scratch buffers) and on
    each row alone (the host path) give the same coefficients."""
    model = tiny_model(random_weights=True)
    B = HOST_ROWS + 1
    site = D._site(model.model.layers[0].attn_hc, B)
    assert use_host(torch.zeros(1, (2 + site.n) * site.n), site.n)  # one row alone takes the host path
    site.base = site.base + 6 * torch.randn(site.base.shape, generator=torch.Generator().manual_seed(5))
    streams = torch.randn(B, site.n, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        batched = D._coefficients(site, streams)
        alone = [D._coefficients(site, streams[b : b + 1]) for b in range(B)]
    for i, got in enumerate(batched):
        torch.testing.assert_close(got, torch.cat([a[i] for a in alone]), rtol=2e-6, atol=1e-7)


def test_mixers_layout_and_paths():
    """decode._mixers (the decode step's layout: pre [B, 1, N], [comb^T | post] [B, N, N+1]) holds
    decode._coefficients' numbers, on the host path (one row) and the tensor path (HOST_ROWS + 1 rows); the mix
    as one product equals decode._mix."""
    model = tiny_model(random_weights=True)
    for B in (1, HOST_ROWS + 1):
        site = D._site(model.model.layers[0].attn_hc, B)
        streams = torch.randn(B, site.n, model.config.hidden_size, generator=torch.Generator().manual_seed(B))
        out = torch.randn(B, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
        with torch.inference_mode():
            pre, post, comb = D._coefficients(site, streams)
            pre3, mixer = D._mixers(site, streams)
            mixed, expected = D._mix_step(streams, mixer, out), D._mix(streams, comb, post, out)
        assert pre3.shape == (B, 1, site.n) and mixer.shape == (B, site.n, site.n + 1)
        torch.testing.assert_close(pre3[:, 0], pre, rtol=0, atol=0)
        torch.testing.assert_close(mixer, torch.cat([comb.transpose(1, 2), post[:, :, None]], dim=-1), rtol=0, atol=0)
        torch.testing.assert_close(mixed, expected, rtol=1e-6, atol=1e-6)
