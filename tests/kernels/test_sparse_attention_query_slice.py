"""Top-k sparse attention with fewer queries than keys (context parallelism: a rank's queries over the whole
sequence's keys): a slice of the queries, with their rows of top-k, gives that slice of the full output, and the
key/value gradients of the slices sum to the full ones. Both backends, both kernels, the dense-span and the
gather paths of the absorbed kernel (a narrow causal prefix and a wide sparse one).

Legend (glm53/model/__init__.py): B batch, T queries, S keys, H heads, K key width, V value width, Z latent width,
J selected slots.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels import kernel, use_backend
from glm53.kernels import sparse_attention as sa_mod

B, S, H, K, V, Z = 2, 48, 3, 8, 6, 10
SLICES = [(0, 11), (11, 20), (31, 17)]  # (offset, length): cover [0, S) in uneven parts


def causal_topk(J: int, seed: int) -> torch.Tensor:
    """[B, S, J] random distinct visible keys per query (s <= t), -1 in the slots a short prefix cannot fill."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(B, S, S, generator=g).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -1.0)
    values, idx = noise.topk(J, dim=-1)
    return idx.masked_fill(values < 0, -1)


def run(op: str, q, kvs, topk, w):
    """Output and gradients of sum(out * w)."""
    q = q.clone().requires_grad_()
    kvs = [t.clone().requires_grad_() for t in kvs]
    out = kernel(op)(q, *kvs, topk, K**-0.5)
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
            torch.randn(B, S, H, K, generator=g),
            [torch.randn(B, S, H, K, generator=g), torch.randn(B, S, H, V, generator=g)],
        )
    else:
        q, kvs = torch.randn(B, S, H, Z, generator=g), [torch.randn(B, S, Z, generator=g)]
    q, kvs = q.double(), [t.double() for t in kvs]
    topk = causal_topk(J, seed=J)
    w = torch.randn(B, S, H, V if op == "sparse_attention" else Z, generator=g, dtype=torch.float64)
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
